"""``python -m octoplan`` = the ``octoplan`` command."""

from octoplan.cli import main

if __name__ == "__main__":
    main()
