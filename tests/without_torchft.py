"""pytest plugin: run tests as on a machine without torchft (the optional ``[ft]`` extra).

    python -m pytest -p tests.without_torchft tests/unit/test_fault_tolerance_parts.py

``import torchft`` then raises ModuleNotFoundError and ``importlib.util.find_spec("torchft")``
is None, as when it is not installed.
"""

import sys

for _name in [m for m in sys.modules if m == "torchft" or m.startswith("torchft.")]:
    del sys.modules[_name]
sys.modules["torchft"] = None  # type: ignore[assignment]
