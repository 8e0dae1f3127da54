"""Put first on PYTHONPATH of a job (tests/examples does for every example it
runs): a Python warning whose nearest caller outside the installed libraries
and the standard library is a file of this repository (pydist/, examples/)
raises RuntimeError instead of being shown, naming both places. So pydist's
own code cannot make torch warn (a deprecated collective once per rank), even
where torch attributes the warning to its own wrapper (c10d_logger.py), as
a filter on the warning's module would miss.

Hooked at warnings._showwarnmsg, which both warnings.warn (C) and
warn_explicit call for every warning the filters let through; a script's
logging.captureWarnings(True) replaces showwarning, one level below.
"""

import os
import sys
import sysconfig
import warnings

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
_LIBRARIES = tuple({os.path.realpath(sysconfig.get_paths()[key]) + os.sep
                    for key in ("stdlib", "platstdlib", "purelib", "platlib")})
_THIS_FILE = os.path.realpath(__file__)
_show = warnings._showwarnmsg


def _repository_caller():
    """file:line of the nearest frame outside the libraries, if it is this repository's."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        path = os.path.realpath(filename)
        if not filename.startswith("<") and path != _THIS_FILE and not path.startswith(_LIBRARIES):
            return f"{path}:{frame.f_lineno}" if path.startswith(_REPO + os.sep) else None
        frame = frame.f_back
    return None


def _showwarnmsg(message):
    caller = _repository_caller()
    if caller is not None:
        raise RuntimeError(f"a warning from this repository's code (warnings are errors here: "
                           f"tests/examples/warnings_are_errors): {message.category.__name__}: {message.message} "
                           f"(warned at {message.filename}:{message.lineno}, called from {caller})")
    _show(message)


warnings._showwarnmsg = _showwarnmsg
