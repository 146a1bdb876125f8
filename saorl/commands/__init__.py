"""One module per ``saorl`` subcommand: the only place that parses arguments, prints for the user
and chooses an exit code. Each exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Nothing outside :mod:`saorl.cli` imports from here."""
