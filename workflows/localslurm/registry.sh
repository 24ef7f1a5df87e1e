#!/usr/bin/env bash
# The local cluster's container registry: Debian's docker-registry (distribution 2.8) on
# 127.0.0.1 only, htpasswd (bcrypt) authentication over TLS from a local CA. Idempotent.
#
#   registry.sh start    # start it (or confirm it runs); make slurm-up calls this
#   registry.sh stop     # stop it; its images, password and certificates are kept
#   registry.sh status   # exit 0 when it answers
#
# State under $VITPOD_SLURM_STATE/registry (default .slurm/registry): private/ (0700: keys,
# htpasswd), trust/ca.crt (the local CA), data/ (the images). $STATE/registry.env (0600)
# exports VITPOD_REGISTRY, VITPOD_REGISTRY_USER and VITPOD_REGISTRY_PASSWORD: source it before
# `make container PUSH=1` or `make pretrain CLUSTER=localregistry`; the password is written
# nowhere else (htpasswd holds its bcrypt hash).
# Trust: the CA goes into the system store (update-ca-certificates), as a site installs its own
# CA on every node: enroot's curl and Python's ssl read it there. enroot.conf's SSL_CERT_FILE
# would not do: Debian's curl 7.88 ignores that variable (CURL_CA_BUNDLE it reads).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
STATE=${VITPOD_SLURM_STATE:-$REPO/.slurm}
DIR=$STATE/registry
PORT=${VITPOD_REGISTRY_PORT:-15000}
ADDR=127.0.0.1:$PORT
ENV_FILE=$STATE/registry.env
USER_NAME=vitpod
PIDFILE=$DIR/registry.pid
SYSTEM_CA=/usr/local/share/ca-certificates/vitpod-local-registry.crt

log() { echo "registry: $*" >&2; }
die() { echo "registry: error: $*" >&2; exit 1; }
export PATH=$PATH:/usr/sbin  # update-ca-certificates

alive() {
  [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null \
    && grep -qx docker-registry "/proc/$(cat "$PIDFILE")/comm" 2>/dev/null
}

answers() {  # /v2/ answers 401 without credentials: up, TLS trusted, authentication on
  [ "$(curl -s -o /dev/null -w '%{http_code}' "https://$ADDR/v2/")" = 401 ]
}

make_ca() {
  [ -s "$DIR/trust/ca.crt" ] && [ -s "$DIR/private/server.crt" ] && return 0
  log "making a local CA and a certificate for $ADDR"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=vitpod local registry CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$DIR/private/ca.key" -out "$DIR/trust/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$DIR/private/server.key" -out "$DIR/private/server.csr" 2>/dev/null
  openssl x509 -req -days 825 -in "$DIR/private/server.csr" -CA "$DIR/trust/ca.crt" \
    -CAkey "$DIR/private/ca.key" -CAcreateserial -out "$DIR/private/server.crt" \
    -extfile <(printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" \
      "basicConstraints=CA:FALSE" "extendedKeyUsage=serverAuth") 2>/dev/null
  chmod 0644 "$DIR/trust/ca.crt"
}

make_credentials() {
  [ -s "$ENV_FILE" ] && [ -s "$DIR/private/htpasswd" ] && return 0
  stop  # distribution reads the htpasswd file once, when it starts
  log "making the registry user $USER_NAME (bcrypt in $DIR/private/htpasswd)"
  local password
  password=$(openssl rand -hex 24)
  # -i: the password from stdin, never on a command line (ps would show it).
  htpasswd -B -i -c "$DIR/private/htpasswd" "$USER_NAME" <<<"$password" 2>/dev/null
  (
    umask 077
    printf '%s\n' "# The local registry (workflows/localslurm/registry.sh); source it." \
      "export VITPOD_REGISTRY=$ADDR" "export VITPOD_REGISTRY_USER=$USER_NAME" \
      "export VITPOD_REGISTRY_PASSWORD=$password" >"$ENV_FILE.tmp"
    mv -f "$ENV_FILE.tmp" "$ENV_FILE"
  )
}

write_config() {  # true when the configuration changed
  cat >"$DIR/private/config.yml.new" <<EOF
# Written by workflows/localslurm/registry.sh (distribution 2.8 configuration).
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $DIR/data}
  delete: {enabled: true}
http:
  addr: $ADDR
  tls: {certificate: $DIR/private/server.crt, key: $DIR/private/server.key}
  # HTTP/1.1 only: enroot 4.1.2 finds the Basic token in curl's verbose output by the header
  # "Authorization: Basic", which curl 7.88 prints in lower case over HTTP/2 (enroot then
  # sends no credentials and gets 401).
  http2: {disabled: true}
auth:
  htpasswd: {realm: vitpod-local, path: $DIR/private/htpasswd}
EOF
  if cmp -s "$DIR/private/config.yml.new" "$DIR/private/config.yml"; then
    rm -f "$DIR/private/config.yml.new"
    return 1
  fi
  mv -f "$DIR/private/config.yml.new" "$DIR/private/config.yml"
}

trust_on_nodes() {
  cmp -s "$DIR/trust/ca.crt" "$SYSTEM_CA" && return 0
  log "adding the local CA to the system store ($SYSTEM_CA)"
  install -m 0644 "$DIR/trust/ca.crt" "$SYSTEM_CA"
  update-ca-certificates >/dev/null 2>&1 || die "update-ca-certificates failed"
}

start() {
  [ "$(id -u)" = 0 ] || die "must run as root (it adds the local CA to the system store)"
  for tool in docker-registry htpasswd openssl curl update-ca-certificates; do
    command -v "$tool" >/dev/null || die "$tool not found; run 'make setup' (docker-registry, apache2-utils)"
  done
  mkdir -p "$DIR/private" "$DIR/trust" "$DIR/data"
  chmod 0755 "$STATE" "$DIR" "$DIR/trust"
  chmod 0700 "$DIR/private" "$DIR/data"
  make_ca
  make_credentials
  if write_config; then stop; fi  # a changed configuration needs a restart
  trust_on_nodes
  if ! alive; then
    answers && die "something else answers on $ADDR; stop it or set VITPOD_REGISTRY_PORT"
    log "starting docker-registry on $ADDR"
    setsid docker-registry serve "$DIR/private/config.yml" </dev/null >>"$DIR/registry.log" 2>&1 &
    echo $! >"$PIDFILE"
  fi
  for _ in $(seq 1 60); do answers && break; sleep 0.5; done
  answers || die "docker-registry does not answer on https://$ADDR/v2/ (see $DIR/registry.log)"
  log "up: https://$ADDR (user $USER_NAME; credentials in $ENV_FILE)"
}

stop() {
  alive || { rm -f "$PIDFILE"; return 0; }
  local pid
  pid=$(cat "$PIDFILE")
  log "stopping docker-registry ($pid)"
  kill "$pid"
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$PIDFILE"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) alive && answers ;;
  *) die "usage: registry.sh start|stop|status" ;;
esac
