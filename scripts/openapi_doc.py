"""Write the protocol's OpenAPI 3.1 documents, docs/openapi/agent_server.json and
docs/openapi/policy_endpoint.json, from controller/agent_server/openapi.py.

    python scripts/openapi_doc.py          # rewrite both files
    python scripts/openapi_doc.py --check  # exit 1 if a file is not what this writes

tests/test_openapi_spec.py runs the check, and checks the documents against the real
servers (their routes, their real requests and answers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rolloutdb.controller.agent_server.openapi import DOCUMENTS
from rolloutdb.store.fsio import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "docs" / "openapi"


def rendered() -> dict[Path, str]:
    return {DIR / name: json.dumps(build(), indent=1, sort_keys=True) + "\n" for name, build in DOCUMENTS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs from what would be written")
    args = ap.parse_args(argv)
    stale = [p for p, text in rendered().items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is out of date: run python scripts/openapi_doc.py", file=sys.stderr)
        return 1 if stale else 0
    DIR.mkdir(parents=True, exist_ok=True)
    for p, text in rendered().items():
        write_file_atomic(p, text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
