"""The command-line convention of every flatflower command (the user's, tools/, and the
runtime's own, such as the SuperNode's ``flatflower-worker``): bad input is one ``error:`` line
and exit code 2.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``error:`` line and exit code 2 (argparse's own
    print the whole usage first); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
