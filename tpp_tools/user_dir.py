"""tpp-user-dir: prints the folder of the installed plugin, for fairseq's ``--user-dir``.

    fairseq-train data-bin/en-de --user-dir "$(tpp-user-dir)" --arch transformer_pp ...

The folder is found, not imported (importing the plugin imports fairseq), so this is
instant; it is the same folder the ``tpp-...`` commands pass to fairseq themselves."""

import argparse
import sys

from .evaluate import EvaluationError, plugin_dir


def main(argv=None):
    argparse.ArgumentParser(prog="tpp-user-dir", description=__doc__.split("\n\n")[0]).parse_args(
        argv
    )
    try:
        print(plugin_dir())
    except EvaluationError as error:
        print(f"tpp-user-dir: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
