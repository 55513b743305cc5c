"""The `pd` command and its subcommands (generate, launch, bench, keygen), each imported only
when it runs."""
