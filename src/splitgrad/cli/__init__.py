"""Sub-commands of ``python -m splitgrad``; one module per command, each with ``add_parser(subparsers)``."""
