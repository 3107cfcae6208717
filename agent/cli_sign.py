"""`edge-agent sign VERSION_FOLDER --key PRIVATE_KEY.pem`: write the version's `model.sig`.

Run on the build machine, where the private key lives; the box holds only the public key
or the CA certificates (`[models.trust]`, docs/operations.md "Signed models"). The key's
contents and its password are never printed or logged: errors name the file only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["add_arguments", "run_from_args"]

PASSWORD_ENV = "EDGE_AGENT_SIGNING_KEY_PASSWORD"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="the version folder, e.g. models/resnet/3")
    parser.add_argument(
        "--key", required=True, type=Path, help="PEM private key (EC P-256, P-384 or P-521)"
    )
    parser.add_argument(
        "--certificate", type=Path, help="the key's signing certificate (certificate mode)"
    )
    parser.add_argument(
        "--certificate-chain",
        type=Path,
        action="append",
        default=[],
        metavar="PEM",
        help="intermediate and root certificates to put in the signature (repeatable)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Sign, then print what was signed; exit 2 on a usage problem, 1 when signing fails.
    An encrypted key's password comes from $EDGE_AGENT_SIGNING_KEY_PASSWORD (key mode)."""
    folder: Path = args.folder
    if not folder.is_dir():
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    if args.certificate_chain and args.certificate is None:
        print("error: --certificate-chain needs --certificate", file=sys.stderr)
        return 2
    try:
        from agent.models.trust import sign_version

        target = sign_version(
            folder,
            args.key,
            certificate=args.certificate,
            certificate_chain=args.certificate_chain,
            password=os.environ.get(PASSWORD_ENV),
        )
    except ImportError as e:
        print(f"error: {e}; install it: pip install 'edge-stream-agent[signing]'", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as e:
        # Messages name files and curves, never key material (cryptography's errors do not).
        print(f"error: cannot sign {folder}: {_one_line(e)}", file=sys.stderr)
        return 1
    print(f"wrote {target} over {_count_files(folder)} file(s)")
    return 0


def _one_line(exc: BaseException) -> str:
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return " ".join(f"{text} ({exc.filename})".split()) if isinstance(exc, OSError) else text


def _count_files(folder: Path) -> int:
    from agent.models.trust import SIGNATURE_FILE

    return sum(1 for p in folder.rglob("*") if p.is_file() and p.name != SIGNATURE_FILE)
