"""`rolloutdb conformance URL`: run the conformance kit
(controller/agent_server/conformance.py) against an agent server and print one row per
guarantee. Exit 0 when no check failed, 1 when one did, 2 when the arguments are unusable."""

from __future__ import annotations

import argparse
import sys

EXIT_FAILED = 1
EXIT_USAGE = 2

DESCRIPTION = """\
Drive the agent server at URL through the protocol of docs/agent_server.md and check
its guarantees, one named check each: export_equals_restore, export_is_the_commit_copy,
lease_releases_dispatch, retired_key_never_returns, restored_twice_not_duplicated,
killed_between_prepare_and_commit (only with --restart-cmd), malformed_requests_get_4xx,
fencing (skipped as "not implemented" unless GET /health says "fencing": true).
The kit serves its own policy endpoint on 127.0.0.1 and resets the server between checks:
point it at a server no run is using, started without a --policy-url of its own.
Exit 0 when nothing failed (skipped checks are not failures), 1 otherwise.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "conformance", help="check that an agent server keeps the protocol's guarantees",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8700")
    parser.add_argument("--key-file", default=None, help="a file (mode 0600) holding the server's bearer token")
    parser.add_argument("--restart-cmd", default=None, help="a shell command that kills the server hard and starts "
                        "it again at the same URL (runs the killed_between_prepare_and_commit check)")
    parser.add_argument("--lease-s", type=float, default=1.0, help="the lease the lease check asks for (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object {ok, results: [{guarantee, "
                        "status, detail, request, got}]} instead of the table; exit codes are the same")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rolloutdb.controller.agent_server import auth, conformance

    try:
        token = auth.read_token_file(args.key_file, "--key-file") if args.key_file else None
        if not 0 < args.lease_s <= 60:
            raise ValueError(f"--lease-s {args.lease_s:g}: give a lease in (0, 60] seconds")
        kit = conformance.Kit(args.url, token, restart_cmd=args.restart_cmd, lease_s=args.lease_s)
    except (ValueError, OSError) as e:
        print(f"error: rolloutdb conformance: {(str(e).splitlines() or [''])[0]}", file=sys.stderr)
        return EXIT_USAGE
    results = kit.run()
    print(conformance.results_json(results) if args.json else conformance.results_table(results))
    return EXIT_FAILED if conformance.failed(results) else 0
