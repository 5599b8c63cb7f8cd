"""tpp-user-dir: prints the folder of the installed plugin, for fairseq's ``--user-dir``.

    fairseq-train data-bin/en-de --user-dir "$(tpp-user-dir)" --arch transformer_pp ...

The folder is found, not imported (importing the plugin imports fairseq), so this is
instant; it is the same folder the ``tpp-...`` commands pass to fairseq themselves."""

import argparse
import importlib.util
import sys
from pathlib import Path

from tpp_pipeline.errors import UserError, report


class PluginNotFound(UserError, LookupError):
    status = 1

    """This Python cannot find the ``tpp_plugin`` package."""


def plugin_dir() -> Path:
    """The folder of the installed ``tpp_plugin`` package (found, not imported: importing
    it imports fairseq), for fairseq's ``--user-dir``."""
    spec = importlib.util.find_spec("tpp_plugin")
    if spec is None or not spec.submodule_search_locations:
        raise PluginNotFound("the tpp_plugin package is not installed: pass --user-dir")
    return Path(list(spec.submodule_search_locations)[0])


def main(argv=None):
    argparse.ArgumentParser(prog="tpp-user-dir", description=__doc__.split("\n\n")[0]).parse_args(
        argv
    )
    try:
        print(plugin_dir())
    except PluginNotFound as error:
        return report("tpp-user-dir", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
