"""One module per command; each exports HELP, configure(parser) and run(args)."""
