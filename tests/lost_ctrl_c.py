"""A Ctrl-C whose KeyboardInterrupt Python loses, planted in a `rolloutdb` command.

Its handler runs inside a `__del__` (as it did inside SQLAlchemy's weakref callback
`_collection_gced` in a CI run): Python prints "Exception ignored in ..." and goes on. The
plant wraps one function the command calls early; `rolloutdb/commands/_stop_signals.py`
is what must still stop the command.
"""

_SCRIPT = """
import os, signal, sys
import {module} as target
from rolloutdb import cli

real = target.{function}


class LosesItsException:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(100))  # the handler runs here, inside __del__: its KeyboardInterrupt is lost


def planted(*args, **kwargs):
    LosesItsException()  # collected at once
    return real(*args, **kwargs)


target.{function} = planted
sys.exit(cli.main(sys.argv[1:]))
"""


def script(module: str, function: str) -> str:
    """`python -c` source that runs the CLI (its arguments) with `module.function`
    losing a Ctrl-C each time it is called."""
    return _SCRIPT.format(module=module, function=function)
