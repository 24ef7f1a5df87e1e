# vitpod: one command on a login node. `make help` lists targets and variables.
SHELL := /bin/bash
VENV ?= .venv
PY := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)

# The make variables users may set, with their defaults (the one table of them).
CLUSTER ?= local
STAGE ?= pretrain
MODEL ?=
NODES ?=
TIME ?=
FT_CLUSTER ?=
FT_NODES ?=
FT_TIME ?=
ACCOUNT ?=
QOS ?=
RESERVATION ?=
CONSTRAINT ?=
EXCLUDE ?=
SBATCH_EXTRA ?=
FT_ACCOUNT ?=
FT_QOS ?=
FT_RESERVATION ?=
FT_CONSTRAINT ?=
FT_EXCLUDE ?=
FT_SBATCH_EXTRA ?=
ARGS ?=
FINETUNE_FROM ?=
RUN ?=
STUDY ?=
MODE ?= strong
GPUS ?= 1 2 4
BATCH ?=
ACCUM ?= 1
STEPS ?= 30
IMAGE ?=
PUSH ?=
TEACHER ?=
TEACHER_CKPT ?=
SHARDS ?=
TOKEN_LABELS ?=
TESTS ?= tests
# pytest-xdist workers for `make test` (the tests on the local Slurm share one of them).
TEST_WORKERS ?= 2
FOLLOW ?=
DATA ?=
OUT ?=
NAME ?=
PARTITIONS ?=
OFFLINE ?=
CANCEL ?=
STATE ?=
DRY_RUN ?=
OLDER_THAN ?=
INCLUDE_FINALS ?=
INCLUDE_DISCARDED ?=
YES ?=
CLUSTERS ?= 1
SLURM_VARS := ACCOUNT QOS RESERVATION CONSTRAINT EXCLUDE SBATCH_EXTRA FT_ACCOUNT FT_QOS FT_RESERVATION FT_CONSTRAINT FT_EXCLUDE FT_SBATCH_EXTRA
VALID_VARS := CLUSTER STAGE MODEL NODES TIME FT_CLUSTER FT_NODES FT_TIME $(SLURM_VARS) ARGS FINETUNE_FROM RUN STUDY MODE GPUS BATCH ACCUM STEPS IMAGE PUSH TEACHER TEACHER_CKPT SHARDS TOKEN_LABELS TESTS TEST_WORKERS FOLLOW DATA OUT NAME PARTITIONS OFFLINE CANCEL STATE DRY_RUN OLDER_THAN INCLUDE_FINALS INCLUDE_DISCARDED YES CLUSTERS PLACE DEADLINE VENV
export CLUSTER STAGE MODEL NODES TIME FT_CLUSTER FT_NODES FT_TIME $(SLURM_VARS) ARGS FINETUNE_FROM RUN STUDY MODE GPUS BATCH ACCUM STEPS IMAGE PUSH TEACHER TEACHER_CKPT SHARDS DATA OUT NAME PARTITIONS DEADLINE

# An unknown variable on the command line (a typo such as NODE=5) is an error, not a silent default.
unknown := $(filter-out $(VALID_VARS) MAKEFLAGS,$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
ifneq ($(unknown),)
$(error unknown variable(s) $(unknown); valid variables: $(VALID_VARS))
endif

WF := $(PY) -m vitpod.workflows
# FOLLOW=1 (any value but empty or 0): live view until the run ends (workflows/watching/follow.py).
FOLLOW_FLAG = $(if $(filter-out 0,$(FOLLOW)),--follow)
# OFFLINE=1: render/preflight without asking Slurm (a submission refuses it).
OFFLINE_FLAG = $(if $(filter-out 0,$(OFFLINE)),--offline)
# DRY_RUN=1: pretrain, finetune, pipeline, token-labels, scaling, calibrate print the scripts, write and submit nothing.
DRY_FLAG = $(if $(filter-out 0,$(DRY_RUN)),--dry-run)
# PLACE=1: pretrain, finetune, pipeline choose the node count by predicted finish first
# (workflows/planning/placement.py); DEADLINE= then picks the fewest GPU-hours finishing by it.
PLACE_FLAG = $(if $(filter-out 0,$(PLACE)),--place) --deadline "$$DEADLINE"
# make list filters by CLUSTER only when it is given (its default, local, would hide the rest).
LIST_CLUSTER = $(if $(filter command line environment,$(origin CLUSTER)),--cluster "$$CLUSTER")
# This submission's sbatch options (workflows/planning/sbatchopts.py); FT_...: a pipeline's
# fine-tune.
SLURM_ARGS = --time="$$TIME" --account="$$ACCOUNT" --qos="$$QOS" --reservation="$$RESERVATION" \
  --constraint="$$CONSTRAINT" --exclude="$$EXCLUDE" --sbatch-extra="$$SBATCH_EXTRA"
FT_SLURM_ARGS = --finetune-time="$$FT_TIME" --finetune-account="$$FT_ACCOUNT" --finetune-qos="$$FT_QOS" \
  --finetune-reservation="$$FT_RESERVATION" --finetune-constraint="$$FT_CONSTRAINT" \
  --finetune-exclude="$$FT_EXCLUDE" --finetune-sbatch-extra="$$FT_SBATCH_EXTRA"
STAGE_ARGS = --cluster "$$CLUSTER" --model "$$MODEL" --nodes "$$NODES" --args="$$ARGS" $(SLURM_ARGS)
# FT_NODES/FT_TIME/FT_ACCOUNT/... are the fine-tune stage's of `make pipeline`; one stage takes
# NODES/TIME/ACCOUNT/...
FT_SET = $(strip $(foreach v,FT_CLUSTER FT_NODES FT_TIME $(filter FT_%,$(SLURM_VARS)),$(if $($(v)),$(v))))
FT_ONLY = $(if $(FT_SET),$(error $(FT_SET) set the fine-tune of make pipeline; make $@ runs one stage: use the name without FT_ (NODES=, TIME=, ACCOUNT=, ...)))$(if $(TEACHER)$(TEACHER_CKPT),$(error TEACHER/TEACHER_CKPT make token labels in make pipeline and make token-labels; make $@ would ignore them: drop TEACHER, or pass the labels with ARGS="--token-label-data DIR"))

.PHONY: help setup test lint render place preflight pretrain finetune submit resume pipeline demo status scaling report \
        container slurm-up slurm-down bench calibrate token-labels shards profile doctor list cancel \
        clean-runs

help:
	@echo "targets: setup test lint render place preflight pretrain finetune submit resume pipeline demo status list cancel clean-runs scaling report calibrate token-labels shards profile doctor container slurm-up slurm-down bench"
	@echo "variables (default; the targets that read them):"
	@printf '  %s\n' \
	  "CLUSTER=$(CLUSTER)  the profile: a bundled name, one in \$$VITPOD_PROFILES (~/.config/vitpod/profiles) or a YAML path" \
	  "STAGE=$(STAGE)  render, place, preflight, token-labels, doctor: pretrain or finetune" \
	  "MODEL=$(MODEL)  the recipe (default: the profile's default_model)" \
	  "NODES=$(NODES)  the stage's node count; in a pipeline every stage (a fine-tune partition with fewer nodes keeps its own); resume: the new count" \
	  "TIME=$(TIME)  the stage's time limit; in a pipeline every stage" \
	  "ACCOUNT=  sbatch --account of this submission (render, preflight, pretrain, finetune, pipeline, token-labels, scaling, calibrate, doctor)" \
	  "QOS=  sbatch --qos, the same targets" \
	  "RESERVATION=  sbatch --reservation, the same targets" \
	  "CONSTRAINT=  sbatch --constraint, the same targets" \
	  "EXCLUDE=  nodes to leave out, a Slurm host list (node[03-05],dgx2-07); checked offline" \
	  "SBATCH_EXTRA=  more long sbatch options, e.g. SBATCH_EXTRA=\"--mail-type=END\"" \
	  "FT_CLUSTER=  pipeline, demo: the fine-tune's profile (e.g. another Slurm cluster)" \
	  "FT_NODES=  pipeline: the fine-tune's node count (wins over NODES)" \
	  "FT_TIME=  pipeline: the fine-tune's time limit (wins over TIME)" \
	  "FT_ACCOUNT=  pipeline: the fine-tune's ACCOUNT" \
	  "FT_QOS=  pipeline: the fine-tune's QOS" \
	  "FT_RESERVATION=  pipeline: the fine-tune's RESERVATION" \
	  "FT_CONSTRAINT=  pipeline: the fine-tune's CONSTRAINT" \
	  "FT_EXCLUDE=  pipeline: the fine-tune's EXCLUDE" \
	  "FT_SBATCH_EXTRA=  pipeline: the fine-tune's SBATCH_EXTRA" \
	  "ARGS=$(ARGS)  more trainer flags (or the command's own flags: profile, doctor, calibrate)" \
	  "FINETUNE_FROM=  finetune, pipeline: a pretrain run directory, a timm folder or a checkpoint file" \
	  "RUN=  status, resume, cancel: a run, pipeline or study directory" \
	  "STUDY=  report: a study directory" \
	  "MODE=$(MODE)  scaling: strong or weak" \
	  "GPUS='$(GPUS)'  scaling: the points' GPU counts" \
	  "BATCH=  scaling: strong: the global batch; weak: the per-rank batch" \
	  "ACCUM=$(ACCUM)  scaling: gradient accumulation steps" \
	  "STEPS=$(STEPS)  scaling: optimizer steps per point" \
	  "IMAGE=  container: the image to build" \
	  "PUSH=  container: 1 = push it to the profile's registry" \
	  "FOLLOW=  status, scaling: 1 = a live view until the run ends" \
	  "TEACHER=  token-labels, pipeline: the teacher, a run directory or a timm name" \
	  "TEACHER_CKPT=  token-labels, pipeline: the weights file of a timm-named teacher" \
	  "SHARDS=  token-labels, pipeline: labeling shards (array tasks)" \
	  "TOKEN_LABELS=  demo: 1 = with token labels" \
	  "DATA=  shards: the data set" \
	  "OUT=  shards: the shards' folder" \
	  "NAME=  profile: the new profile's name" \
	  "PARTITIONS=  profile: its pretrain[,finetune] partitions" \
	  "OFFLINE=  render, place, preflight, pipeline, scaling: 1 = ask Slurm nothing (pipeline and scaling render every job, submit nothing)" \
	  "CANCEL=  resume: 1 = cancel the run's pending or running job first" \
	  "STATE=  list, clean-runs: states, e.g. RUNNING,PENDING or FAILED,CANCELLED" \
	  "DRY_RUN=  pretrain, finetune, pipeline, token-labels, scaling, calibrate: 1 = print the scripts, write and submit nothing" \
	  "OLDER_THAN=  clean-runs: only entries older than this, e.g. 7d" \
	  "INCLUDE_FINALS=  clean-runs: 1 = also runs that hold a final model" \
	  "INCLUDE_DISCARDED=  clean-runs: 1 = also runs holding set-aside checkpoints (checkpoints/discarded/)" \
	  "YES=  clean-runs: 1 = delete (without it: print what it would delete)" \
	  "PLACE=  pretrain, finetune, pipeline: 1 = the node count by predicted finish (as make place)" \
	  "DEADLINE=  place, PLACE=1: 6h or 2026-11-28T06:00: the fewest GPU-hours finishing by then" \
	  "CLUSTERS=$(CLUSTERS)  slurm-up: 2 = also the second local cluster (profile localslurm2)" \
	  "TESTS=$(TESTS)  test: what to run" \
	  "TEST_WORKERS=$(TEST_WORKERS)  test: pytest-xdist workers" \
	  "VENV=$(VENV)  the virtual environment"

setup:
	bash scripts/setup.sh

test:
	$(PY) -m pytest -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadgroup $(TESTS)

lint:
	$(PY) -m ruff check vitpod workflows trainer analysis registry tests benchmarks
	$(PY) -m ruff format --check vitpod workflows trainer analysis registry tests benchmarks
	@# mypy reads the package as pip installs it (the wheel's layout), not the checkout's folders
	rm -rf .cache/typecheck build && $(PY) -m pip install --quiet --no-deps --no-build-isolation --no-compile --target .cache/typecheck .
	$(PY) -m mypy .cache/typecheck/vitpod

render:
	$(FT_ONLY)$(WF) render --stage "$$STAGE" $(STAGE_ARGS) $(OFFLINE_FLAG) --finetune-from "$$FINETUNE_FROM"

# Every node count of the stage's range: Slurm's start (sbatch --test-only) + predicted run time;
# renders the earliest finish (DEADLINE=: the fewest GPU-hours by then), prints its job.sbatch.
# OFFLINE=1: Slurm not asked, the candidates ranked by the step model alone (starts unknown).
place:
	$(FT_ONLY)$(WF) place --stage "$$STAGE" $(STAGE_ARGS) $(OFFLINE_FLAG) \
	  --finetune-from "$$FINETUNE_FROM" --deadline "$$DEADLINE"

preflight:
	$(FT_ONLY)$(WF) preflight --stage "$$STAGE" $(STAGE_ARGS) $(OFFLINE_FLAG) --finetune-from "$$FINETUNE_FROM"

pretrain:
	$(FT_ONLY)$(WF) submit --stage pretrain $(STAGE_ARGS) $(OFFLINE_FLAG) $(DRY_FLAG) $(PLACE_FLAG) --finetune-from "$$FINETUNE_FROM"

finetune:
	$(FT_ONLY)$(WF) submit --stage finetune $(STAGE_ARGS) $(OFFLINE_FLAG) $(DRY_FLAG) $(PLACE_FLAG) --finetune-from "$$FINETUNE_FROM"

# RUN=<run or pipeline dir> written by make render / make pipeline OFFLINE=1 (reviewed): the
# preflight again against the live cluster, then exactly those files submitted; a file changed
# since rendering is refused by name (rendered.sha256). DRY_RUN=1: the checks only (one run).
submit:
	$(if $(RUN),,$(error make submit needs RUN=<the run or pipeline directory make render / make pipeline OFFLINE=1 printed>))$(WF) submit "$$RUN" $(DRY_FLAG)

# RUN=<run dir> NODES=M: continue a stopped run on M nodes, same global batch
# (workflows/submit/resume.py). CANCEL=1: cancel the run's job still pending or running first
# (resume refuses otherwise).
resume:
	$(WF) resume --run "$$RUN" --nodes "$$NODES" $(SLURM_ARGS) $(if $(filter-out 0,$(CANCEL)),--cancel-running)

pipeline:
	$(WF) pipeline $(STAGE_ARGS) --finetune-cluster "$$FT_CLUSTER" --finetune-nodes "$$FT_NODES" $(FT_SLURM_ARGS) \
	  --teacher "$$TEACHER" --teacher-checkpoint "$$TEACHER_CKPT" $(OFFLINE_FLAG) $(DRY_FLAG) \
	  $(PLACE_FLAG) --finetune-from "$$FINETUNE_FROM"

demo:
	$(WF) demo --cluster "$$CLUSTER" --finetune-cluster "$$FT_CLUSTER" $(if $(TOKEN_LABELS),--token-labels)

status:
	$(WF) status --run "$$RUN" $(FOLLOW_FLAG)

# Runs, pipelines and studies under the run root (VITPOD_RUN_ROOT, else CLUSTER's storage.runs;
# neither: every known profile's storage.runs, the roots searched said on stderr).
list:
	$(WF) list --state "$$STATE" --model "$$MODEL" $(LIST_CLUSTER)

# Every job of RUN (a run, pipeline or study directory), pending and running; the directory stays.
cancel:
	$(WF) cancel --run "$$RUN"

# Delete old or ended runs, pipelines and studies under the run root
# (workflows/watching/runclean.py): OLDER_THAN=7d and/or STATE=FAILED,CANCELLED; prints the plan
# with sizes, YES=1 deletes. Live jobs' runs, final models (unless INCLUDE_FINALS=1), set-aside
# checkpoints (unless INCLUDE_DISCARDED=1) and what a kept run reads from are kept. (Not `clean`: that name conventionally removes build outputs.)
clean-runs:
	$(WF) clean --older-than "$$OLDER_THAN" --state "$$STATE" $(LIST_CLUSTER) \
	  $(if $(filter-out 0,$(INCLUDE_FINALS)),--include-finals) $(if $(filter-out 0,$(YES)),--yes) \
	  $(if $(filter-out 0,$(INCLUDE_DISCARDED)),--include-discarded)

# Token labels for STAGE's data and grid (img_size/16), from TEACHER (a run dir or weights file;
# or a timm name with TEACHER_CKPT): a Slurm job array, one shard per rank.
token-labels:
	$(WF) token-labels --stage "$$STAGE" --cluster "$$CLUSTER" --model "$$MODEL" --nodes "$$NODES" \
	  --shards "$$SHARDS" --teacher "$$TEACHER" --teacher-checkpoint "$$TEACHER_CKPT" --args="$$ARGS" $(SLURM_ARGS) $(DRY_FLAG)

scaling:
	$(WF) scaling --cluster "$$CLUSTER" --model "$$MODEL" --mode "$$MODE" --gpus "$$GPUS" --batch "$$BATCH" --accum "$$ACCUM" --steps "$$STEPS" --args="$$ARGS" $(SLURM_ARGS) $(FOLLOW_FLAG) $(DRY_FLAG) $(OFFLINE_FLAG)

report:
	$(PY) -m vitpod.analysis report "$$STUDY"

# Time collectives on the partition's nodes, fit latency/bandwidth, store <profile>.calibration.json
# (ARGS: trainer.engines.commbench flags, e.g. ARGS="--sizes '4K 1M 16M' --iters 20").
calibrate:
	$(WF) calibrate --cluster "$$CLUSTER" --nodes "$$NODES" --args="$$ARGS" $(SLURM_ARGS) $(DRY_FLAG)

# Discover a site: Slurm's partitions and nodes, one probe job per node type -> a new profile
# (never overwrites). ARGS: more flags, e.g. ARGS="--base localslurm --storage-hca mlx5_4,mlx5_5",
# or ARGS="--check <profile>" to list where an existing profile disagrees with the nodes.
profile:
	$(WF) profile --name "$$NAME" --partitions "$$PARTITIONS" --args="$$ARGS"

# Check the nodes of CLUSTER's STAGE partition (GPUs, InfiniBand, free space, image); names bad
# nodes (ARGS="--auto-exclude": then submits STAGE without them).
doctor:
	$(WF) doctor --cluster "$$CLUSTER" --stage "$$STAGE" --nodes "$$NODES" --args="$$ARGS" $(SLURM_ARGS)

container:
	bash containers/build.sh

# CLUSTERS=2: also a second cluster (own controller, nodes node3/node4, same slurmdbd; profile
# localslurm2), started without restarting the first (workflows/localslurm/cluster2.sh).
slurm-up:
	@case "$(CLUSTERS)" in 1|2) ;; *) echo "CLUSTERS=$(CLUSTERS): use 1 or 2" >&2; exit 2;; esac
	bash workflows/localslurm/up.sh
	$(if $(filter 2,$(CLUSTERS)),bash workflows/localslurm/cluster2.sh)

slurm-down:
	bash workflows/localslurm/down.sh

# Pack an image folder (or CIFAR/digits: ARGS="--dataset cifar10") into webdataset tar shards.
shards:
	@test -n "$$DATA" -a -n "$$OUT" || { echo "usage: make shards DATA=<dataset root> OUT=<folder> [ARGS='--resize 256 --samples-per-shard 1000 --dataset folder']" >&2; exit 2; }
	$(PY) -m vitpod.trainer.data.shards "$$DATA" "$$OUT" $$ARGS

bench:
	$(PY) benchmarks/checkpoint_stall.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/loader.py
