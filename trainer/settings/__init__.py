"""The trainer's settings: flags, config files, timm's args.yaml, the plan, checks."""
