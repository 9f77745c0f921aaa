"""The `tandem` console script's entry: loads the compiled simulator for the plan commands
that simulate (tandem/plan/compiled.py: before anything imports its modules' sources),
then runs the command line (tandem/cli.py)."""

from __future__ import annotations

import sys

from tandem.plan import compiled


def main() -> int:
    compiled.activate_for(sys.argv[1:])
    from tandem.cli import main as cli_main  # after: it imports the router and the engine

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
