"""Seeded, repeatable faults for octorun jobs: a test helper, never a flag of octorun itself.

Run it in octorun's place under torchrun:

    torchrun --nproc-per-node 4 tests/fault_injection.py \\
        --fault attempt=0,rank=1,step=2,at=op:1I3,signal=KILL \\
        --fault attempt=1,rank=2,step=5,at=optimizer,signal=STOP \\
        -- PLAN --steps 8 --save DIR --resume auto ...

Each fault strikes one global rank of one launcher attempt (TORCHELASTIC_RESTART_COUNT, so a
restarted job runs on) at one point of one step, with SIGKILL (the process vanishes) or SIGSTOP
(it hangs: alive, silent). The points:

- ``op:<op>``: before the op runs (``1F3``, ``2I0``, ``0W1``, ``3B2``: its stage and microbatch);
- ``send:<kind>:<stage>:<mb>``: before the message is sent (``act`` forward, ``grad`` backward);
- ``recv:<kind>:<stage>:<mb>``: before the op that takes the message waits for it;
- ``optimizer``: as the step's update begins (before the gradient-norm all-reduce);
- ``save``: in the middle of the step's checkpoint, after this rank wrote its shard and before
  the checkpoint is complete;
- ``evaluate``: as the evaluation after the step begins (``--eval-data``), its checkpoint saved.

Before it strikes, the process appends ``<seconds since epoch> rank=<r> <fault>`` to the file
named by $FAULT_LOG (when set), so a test knows when the fault happened.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    attempt: int
    rank: int
    step: int
    at: str
    signal: str

    @classmethod
    def parse(cls, text: str) -> "Fault":
        fields = dict(part.split("=", 1) for part in text.split(","))
        fault = cls(int(fields["attempt"]), int(fields["rank"]), int(fields["step"]), fields["at"], fields["signal"].upper())
        if fault.signal not in SIGNALS:
            raise SystemExit(f"fault_injection: signal {fault.signal!r} is not one of {', '.join(SIGNALS)}")
        return fault

    def __str__(self) -> str:
        return f"attempt={self.attempt},rank={self.rank},step={self.step},at={self.at},signal={self.signal}"


def strike(fault: Fault) -> None:
    log = os.environ.get("FAULT_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{time.time():.3f} rank={fault.rank} {fault}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), SIGNALS[fault.signal])


def install(fault: Fault) -> None:
    """Patch the one point of octorun where ``fault`` strikes (this process's rank and attempt)."""
    from octorun import comm, runtime

    now = {"step": -1}
    step = runtime._Interpreter.step

    def stepping(self, number):
        now["step"] = number
        return step(self, number)

    runtime._Interpreter.step = stepping
    kind, _, what = fault.at.partition(":")
    if kind == "op":
        run_op = runtime._Interpreter._run_op

        def running(self, op, state):
            if now["step"] == fault.step and str(op) == what:
                strike(fault)
            return run_op(self, op, state)

        runtime._Interpreter._run_op = running
    elif kind in ("send", "recv"):
        message_kind, stage, mb = what.split(":")
        key = (message_kind, int(stage), int(mb))
        if kind == "send":
            send = comm.Transport.send

            def sending(self, message, tensors, *, dst, step, **named):
                if now["step"] == fault.step and (message.kind, message.stage, message.mb) == key:
                    strike(fault)
                return send(self, message, tensors, dst=dst, step=step, **named)

            comm.Transport.send = sending
        else:
            receive = runtime._Interpreter._receive

            def receiving(self, what, local, op, message, state):
                if now["step"] == fault.step and (message.kind, message.stage, message.mb) == key:
                    strike(fault)
                return receive(self, what, local, op, message, state)

            runtime._Interpreter._receive = receiving
    elif kind == "optimizer":
        update = runtime._Interpreter._update

        def updating(self, number, state):
            if number == fault.step:
                strike(fault)
            return update(self, number, state)

        runtime._Interpreter._update = updating
    elif kind == "evaluate":
        evaluate = runtime._Interpreter.evaluate

        def evaluating(self, number):
            if number == fault.step:
                strike(fault)
            return evaluate(self, number)

        runtime._Interpreter.evaluate = evaluating
    elif kind == "save":
        from torch.distributed.checkpoint import filesystem

        write = filesystem.FileSystemWriter.write_data

        def writing(self, plan, planner):
            done = write(self, plan, planner)
            if now["step"] == fault.step:
                done.wait()  # this rank's shard is on disk; the checkpoint is not complete
                strike(fault)
            return done

        filesystem.FileSystemWriter.write_data = writing
    else:
        raise SystemExit(f"fault_injection: unknown point {fault.at!r}")


def main(argv: list[str]) -> None:
    if "--" not in argv:  # no faults (torchrun's parser drops a leading "--")
        if argv and argv[0] == "--fault":
            raise SystemExit("usage: fault_injection.py --fault SPEC [--fault SPEC ...] -- PLAN [octorun options]")
        argv = ["--", *argv]
    split = argv.index("--")
    specs, octorun_args = argv[:split], argv[split + 1:]
    faults = [Fault.parse(spec) for flag, spec in zip(specs[::2], specs[1::2]) if flag == "--fault"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    for fault in faults:
        if fault.attempt == attempt and fault.rank == rank:
            install(fault)
    from octorun.cli import main as octorun_main

    octorun_main(octorun_args)


if __name__ == "__main__":
    main(sys.argv[1:])
