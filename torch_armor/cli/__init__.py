"""The ``torch-armor`` command line: the parser, its subcommands, which flag sets which config field, shared names."""
