"""What traces add to a run request on the wire, on any checkout (its sources first on
``PYTHONPATH``):

    PYTHONPATH=CHECKOUT/proto/src .venv/bin/python tools/hardening/traces.py

With tracing off the edge sends no traceparent: proto3 leaves an empty string out, so
the frame is byte for byte the one before traces. With tracing on it grows by the
traceparent's field (docs/ARCHITECTURE.md#traces). The cost of the request's
accounting with no span is ``tools/hardening/usage_account_cost.py``'s figure.
"""

from __future__ import annotations

from iop_proto.v1 import runtime_pb2 as pb

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def order(**more: object) -> pb.RunRequest:
    """A typical streamed chat run request (a short prompt, a prepared body)."""
    body = b'{"model":"served","messages":[{"role":"user","content":"hi"}],"stream":true}'
    return pb.RunRequest(
        run_id="9f" * 16,
        model="mock-small",
        provider_id="node-a-mock",
        adapter="mock",
        target="served",
        operation=pb.OPERATION_CHAT_COMPLETIONS,
        body_json=body,
        stream=True,
        deadline_unix_ms=1_780_000_000_000,
        include_usage=True,
        body_prepared=True,
        prompt_blocks=[1, 2, 3],
        **more,  # type: ignore[arg-type]
    )


def main() -> None:
    off = order().SerializeToString()
    print(f"run request, tracing off: {len(off)} bytes")
    if "traceparent" in pb.RunRequest.DESCRIPTOR.fields_by_name:
        on = order(traceparent=TRACEPARENT).SerializeToString()
        print(f"run request, tracing on:  {len(on)} bytes (+{len(on) - len(off)})")
    else:
        print("run request, tracing on:  (no traceparent field: this checkout has no traces)")


if __name__ == "__main__":
    main()
