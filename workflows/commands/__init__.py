"""The subcommands over every other layer: status, list, chain, doctor, profile."""
