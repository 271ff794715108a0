"""The `pgoutbox` command: main.py builds the parser from one module per
subcommand (COMMAND, HELP, CONFIG, SETTINGS, run(cfg, args)); every flag is
the twin of an OUTBOX_* variable. Commands sit on top: they may use core,
outbox and inbox, and nothing below imports them."""
