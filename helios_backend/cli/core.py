"""helios-core: inspect, verify, make publisher keys and sign prepared cores.

    helios-core inspect CORE                    readable summary of a core
    helios-core verify CORE [--accept NS]       every commitment, signature and the contract
    helios-core keygen [--key PATH]             create (or show) a publisher key
    helios-core sign CORE --out OUT [--key PATH] [--namespace NS]
                                                re-sign a verified core under your key

Exit status: 0 when everything holds, 1 with the reason on stderr otherwise, 2 for usage.
`--content-key-file` (32 raw bytes or 64 hex digits) opens ProtectedIndex v4 cores.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Sequence, TextIO

from helios_backend.contract import ContractError, PreparedContract
from helios_backend.core import (
    Core,
    CoreError,
    default_key_path,
    load_or_create_publisher_key,
    open_core,
    public_key_bytes,
    resign_core,
)
from helios_proto import contract_pb2 as c

MB = 1e6


def _content_key(path: pathlib.Path | None) -> bytes | None:
    if path is None:
        return None
    raw = path.read_bytes()
    text = raw.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode())
        except ValueError:
            pass
    return raw


def _enum_name(enum, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:
        return f"<unknown {value}>"


def _print_summary(core: Core, out: TextIO) -> None:
    contract, model = core.contract, core.contract.model
    print(f"core            {core.path}", file=out)
    print(f"carrier         {core.format} (payload format {core.payload_format})", file=out)
    print(f"namespace       {core.namespace}", file=out)
    print(f"publisher key   {core.public_key.hex()}", file=out)
    print(f"served id       {contract.served_id}" + (f"  aliases: {', '.join(contract.aliases)}" if contract.aliases else ""), file=out)
    print("version domains "
          f"execution ABI {core.versions.execution_abi or '-'} | contract {core.versions.contract_version} | "
          f"payload format {core.versions.payload_format}", file=out)
    print(f"extents         context {contract.context_tokens} | prefill {contract.prefill_tokens} | "
          f"concurrency {contract.concurrency} | pages {contract.prepared_pages} | snapshots {contract.prepared_snapshots} | "
          f"speculative widths {list(contract.speculative_widths) or '-'}", file=out)
    print("resources", file=out)
    for info in core.resources:
        ratio = info.decoded_nbytes / info.stored_nbytes if info.stored_nbytes else 0.0
        print(f"  {info.id:<28} {info.kind_name:<30} {info.decoded_nbytes:>14,d} B decoded "
              f"{info.stored_nbytes:>14,d} B stored  x{ratio:5.2f}  {info.chunks} chunk(s)", file=out)
    _print_architectures(core, out)
    print("graphs", file=out)
    for graph in model.graphs:
        line = (f"  {graph.program:<28} {_enum_name(c.Operation, graph.operation):<26} rank {graph.rank} "
                f"rows {graph.capacity.rows} tokens {graph.capacity.tokens}")
        if graph.HasField("speculative"):
            s = graph.speculative
            line += f"  B={s.batch_capacity} D={s.draft_tokens} W={s.token_capacity} P={s.packed_token_capacity}"
        print(line, file=out)
    fe = model.frontend
    print("frontend        "
          f"tools {_enum_name(c.ToolParser, fe.tool_parser)} | reasoning {_enum_name(c.ReasoningParser, fe.reasoning_parser)} | "
          f"image preparation {_enum_name(c.ImagePreparation, fe.image_preparation)} | "
          f"image layout {_enum_name(c.ImageLayout, fe.image_layout)}", file=out)


def _print_architectures(core: Core, out: TextIO) -> None:
    """One line per kernel architecture the core serves (the CUDA executor loads one of them)."""
    from helios_backend.executors.cuda.errors import ManifestError
    from helios_backend.executors.cuda.modules import architectures, capability_name

    try:
        found = architectures(core.manifest.modules)
    except ManifestError as exc:
        print(f"architectures   INVALID: {exc}", file=out)
        return
    print(f"architectures   {', '.join(a.name for a in found) or 'none (no kernel modules)'}", file=out)
    sizes = {info.id: info.decoded_nbytes for info in core.resources}
    for arch in found:
        kernels = [k for module in arch.modules for k in module.kernels]
        runs = (f"PTX for >= {capability_name(arch.capability)}, JIT at startup" if arch.portable
                else f"cubin for {capability_name(arch.capability)}")
        toolchains = sorted({module.toolchain for module in arch.modules})
        print(f"  {arch.name:<11} {runs:<42} {len(arch.modules):>3} modules {len(kernels):>3} kernels "
              f"{sum(sizes.get(m.resource, 0) for m in arch.modules):>12,d} B  "
              f"PDL {sum(k.programmatic_dependent_launch for k in kernels)}/{len(kernels)}  {', '.join(toolchains)}",
              file=out)


def _inspect(args: argparse.Namespace) -> int:
    with open_core(args.core, content_key=_content_key(args.content_key_file)) as core:
        _print_summary(core, sys.stdout)
        try:
            core.prepared_contract()
            print("contract        valid")
        except ContractError as exc:
            print(f"contract        INVALID: {exc}")
            return 1
    return 0


def _verify(args: argparse.Namespace) -> int:
    with open_core(args.core, content_key=_content_key(args.content_key_file)) as core:
        total = sum(info.decoded_nbytes for info in core.resources)
        def report(info) -> None:  # one line per resource, for multi-GiB cores
            print(f"verified {info.id} ({info.decoded_nbytes / MB:.1f} MB)", file=sys.stderr)

        core.verify(on_resource=report if args.verbose else None)
        prepared: PreparedContract = core.prepared_contract()
        if args.accept is not None:
            core.authorize(args.accept)
        accepted = f", accepted as {args.accept!r}" if args.accept is not None else " (no --accept: not authorized)"
        print(f"OK: {len(core.resources)} resources ({total / MB:.1f} MB decoded), signature and commitments hold, "
              f"contract v{prepared.versions.contract} valid{accepted}")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    path = args.key or default_key_path()
    existed = path.exists()
    key = load_or_create_publisher_key(path)
    print(f"{'existing' if existed else 'created'} publisher key {path}")
    print(f"public key {public_key_bytes(key).hex()}")
    return 0


def _sign(args: argparse.Namespace) -> int:
    key = load_or_create_publisher_key(args.key)
    resign_core(args.core, args.out, signing_key=key, namespace=args.namespace,
                content_key=_content_key(args.content_key_file))
    with open_core(args.out, content_key=_content_key(args.content_key_file)) as core:
        print(f"signed {args.out} for namespace {core.namespace!r} with key {core.public_key.hex()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helios-core", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print a readable summary of a core")
    verify = commands.add_parser("verify", help="check every commitment, signature and the contract")
    verify.add_argument("--accept", metavar="NAMESPACE", help="authorize: must equal the signed namespace exactly (default: no authorization check)")
    verify.add_argument("-v", "--verbose", action="store_true", help="report each resource as it verifies (default: off)")
    for sub in (inspect, verify):
        sub.add_argument("core", type=pathlib.Path, help="the core file")
    keygen = commands.add_parser("keygen", help="create or show the publisher key")
    keygen.add_argument("--key", type=pathlib.Path, help="key file (default: $HELIOS_HOME/keys/publisher.ed25519.pem, else "
                                                        "~/.local/share/helios/keys/publisher.ed25519.pem)")
    sign = commands.add_parser("sign", help="verify a core, then re-sign it under your key")
    sign.add_argument("core", type=pathlib.Path, help="the core file to re-sign")
    sign.add_argument("--out", type=pathlib.Path, required=True, help="where to write the re-signed core (required)")
    sign.add_argument("--key", type=pathlib.Path, help="key file (default: the publisher key)")
    sign.add_argument("--namespace", help="publisher namespace to sign (default: keep the core's)")
    for sub in (inspect, verify, sign):
        sub.add_argument("--content-key-file", type=pathlib.Path, help="content key of a ProtectedIndex v4 core (default: none)")
    inspect.set_defaults(run=_inspect)
    verify.set_defaults(run=_verify)
    keygen.set_defaults(run=_keygen)
    sign.set_defaults(run=_sign)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CoreError, ContractError) as exc:
        print(f"FAIL: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
