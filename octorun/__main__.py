"""``python -m octorun`` = the ``octorun`` command."""

from octorun.cli import main

if __name__ == "__main__":
    main()
