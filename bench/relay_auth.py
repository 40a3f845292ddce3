"""What CURVE costs the relay: rows/s into the notebook with and without it.

A sender process (a stand-in for a rank: a PUSH socket, a CURVE client with the relay's keys
when the relay has them) sends ``--messages`` messages (``count`` mode: 20 times as many)
of ``--rows`` ``StepMetrics`` rows each, already encoded in the relay's wire format, as fast
as the socket takes them; this process
runs a real ``relay.Relay`` (``auth="curve"`` or ``None``) and times from the go signal until
the last row arrived. Two receiving modes: ``decode`` (a bus subscriber is present, so the
relay decodes every row and re-emits it, as with a dashboard open) and ``count`` (nobody
subscribed: the relay only counts messages, so what is left is the transport, where CURVE's
encryption sits). Contenders alternate block by block (a shared machine's noise hits both);
the medians and their ratio are printed, and the JSON of every block with ``--json``.

    OMP_NUM_THREADS=1 python bench/relay_auth.py --blocks 6
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time


def _send(address, keys, messages, rows, ready, go, nbytes):
    import zmq

    from colossal_lab import relay
    from colossal_lab.engine import telemetry as T
    from colossal_lab.relay_auth import secure_client

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    row = T.to_row(T.StepMetrics(rank=0, step=123456, loss=1.2345, tokens=4096, seconds=0.0123))
    msg = relay.encode([row] * rows, rows)
    nbytes.value = sum(len(f) for f in msg)
    sock.send_multipart(msg)  # the handshake and the first message, before the clock starts
    ready.set()
    go.wait()
    for _ in range(messages):
        sock.send_multipart(msg, copy=False)
    sock.close(linger=-1)  # until everything was handed to the relay
    ctx.term()


class _Idle:
    running = True

    def run(self, fn, *args):
        return []


def block(auth, mode, messages, rows) -> dict:
    from colossal_lab import relay
    from colossal_lab.engine import telemetry

    unsub = telemetry.subscribe(lambda e: None) if mode == "decode" else None
    r = relay.Relay(_Idle(), relay.RelayConfig(interval=0.005, auth=auth))
    spawn = mp.get_context("spawn")
    ready, go, nbytes = spawn.Event(), spawn.Event(), spawn.Value("q", 0)
    p = spawn.Process(target=_send, args=(r.address, r.keys, messages, rows, ready, go, nbytes))
    p.start()
    try:
        ready.wait(60)
        while r.messages < 1:
            time.sleep(0.001)
        base, total = r.received, messages * rows
        t0 = time.perf_counter()
        go.set()
        while r.received - base < total:
            if not p.is_alive() and r.received - base < total and p.exitcode not in (0, None):
                raise RuntimeError(f"sender exited {p.exitcode}")
            time.sleep(0.001)
        dt = time.perf_counter() - t0
        return {"auth": auth or "none", "mode": mode, "rows": total, "seconds": dt,
                "rows_per_s": total / dt, "mb_per_s": messages * nbytes.value / dt / 1e6, "bad": r.bad}
    finally:
        p.join(30)
        r.detach()
        if unsub:
            unsub()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6, help="blocks per contender and mode")
    ap.add_argument("--messages", type=int, default=1500,
                    help="messages per block when decoding (20 times as many when only counting)")
    ap.add_argument("--rows", type=int, default=256, help="rows per message (a rank's batch)")
    ap.add_argument("--json", action="store_true", help="print every block as JSON too")
    args = ap.parse_args()
    out = []
    for mode in ("count", "decode"):
        for i in range(args.blocks):
            order = ("curve", None) if i % 2 == 0 else (None, "curve")
            for auth in order:
                out.append(block(auth, mode, args.messages * (20 if mode == "count" else 1), args.rows))
    print(f"relay rows/s, {args.rows} rows a message, median of {args.blocks} blocks:")
    for mode in ("count", "decode"):
        med = {(a, k): statistics.median(b[k] for b in out if b["mode"] == mode and b["auth"] == a)
               for a in ("none", "curve") for k in ("rows_per_s", "mb_per_s")}
        print(f"  {mode:6s}  no auth {med['none', 'rows_per_s']:12,.0f} ({med['none', 'mb_per_s']:6.1f} MB/s)"
              f"  curve {med['curve', 'rows_per_s']:12,.0f} ({med['curve', 'mb_per_s']:6.1f} MB/s)"
              f"  curve/none {med['curve', 'rows_per_s'] / med['none', 'rows_per_s']:.3f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
