"""One module per `pgoutbox` subcommand (see pgoutbox.cli)."""
