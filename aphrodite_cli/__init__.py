"""aphrodite's command line (Typer). Thin: flags -> typed config -> engine calls."""
