#!/usr/bin/env bash
# The GPU check, in one run of under 8 minutes on one CUDA device:
#   1. the CUDA tests (tests/runtime/learner/test_device.py: snapshot/install/alpha mixing against CPU
#      references, a CUDA learner against a CPU syncer in fp32 and bf16 autocast, a two-rank
#      Gloo island with its model on CUDA; the NCCL islands, DDP and FSDP2 of 2 ranks and HSDP
#      of 2 x 2, need 2 and 4 GPUs and say so);
#   2. bench/gpu_throughput.py: gpt_125m, bf16 autocast, M learners sharing the GPU, tokens/s
#      with sync on against off in adjacent block pairs;
#   3. a profile of the snapshot's stream overlap (torch.profiler trace);
#   4. the syncer sharded over S = 1, 2, 4 processes (bench/perf_syncer.py --scaling; CPU only,
#      it wants the machine's many cores), target >= 0.8 x S.
# Results land in $OUT (default bench/results/gpu): gpu_check.md (summary), pytest.log,
# gpu_throughput.json, gpu_snapshot_trace.json, shard_scaling.{json,md}, nvidia-smi.txt.
#
# Usage, from the repository root on a machine with PyTorch and CUDA:
#   bash bench/gpu_check.sh            # M = 2 learners
#   LEARNERS=4 bash bench/gpu_check.sh
# The package runs from src/ (no install needed). Python packages missing there can be put as
# wheels in .whl/: they are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
LEARNERS=${LEARNERS:-2}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/gpu_check.log" >&2; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  log "$PY cannot import torch: set PYTHON to the interpreter that has PyTorch"
  exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "no CUDA device visible to torch: nothing to check here"
  exit 2
fi
if ! missing=$("$PY" -c "import ddiloco.cli, ddiloco.runtime.learner.hook, ddiloco.runtime.syncer.server" 2>&1); then
  log "ddiloco does not import here; put the missing packages as wheels in .whl/: $missing"
  exit 3
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee -a "$OUT/gpu_check.log"

log "1/4 CUDA tests"
timeout 240 "$PY" -m pytest tests/runtime/learner/test_device.py -v -rs -p no:cacheprovider \
  > "$OUT/pytest.log" 2>&1
tests_rc=$?
tail -n 12 "$OUT/pytest.log" >&2

log "2/4 + 3/4 throughput (M = $LEARNERS) and the snapshot overlap profile"
timeout 330 "$PY" bench/gpu_throughput.py --learners "$LEARNERS" --profile --out "$OUT" \
  >> "$OUT/gpu_check.log" 2>&1
bench_rc=$?

left=$((570 - SECONDS))  # the whole check stays within 10 minutes
if [ "$left" -ge 60 ]; then
  log "4/4 syncer shard scaling, S = 1, 2, 4 (at most $((left < 150 ? left : 150)) s)"
  timeout $((left < 150 ? left : 150)) "$PY" bench/perf_syncer.py --scaling 1,2,4 --learners 8 \
    --rounds 3 --window-s 3 --out "$OUT" >> "$OUT/gpu_check.log" 2>&1 \
    || log "shard scaling failed (exit $?)"
else
  log "4/4 syncer shard scaling skipped: ${left} s left of the 10-minute budget"
fi

"$PY" - "$OUT" "$tests_rc" "$bench_rc" <<'EOF'
import json, re, sys
from pathlib import Path
out, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lines = ["# GPU check", ""]
log = (out / "pytest.log").read_text() if (out / "pytest.log").exists() else ""
tail = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|skipped)", l)]
lines.append(f"- CUDA tests (exit {tests_rc}): {tail[-1].strip('= ') if tail else 'no summary'}")
res = out / "gpu_throughput.json"
if res.exists():
    d = json.loads(res.read_text())
    if "ratio" in d:
        lines.append(f"- throughput, {d['device']}, M = {d['learners']}, gpt_125m, bf16 autocast: "
                     f"sync on / off = {d['ratio']:.2%} (median of {d['pairs']} adjacent block "
                     f"pairs per learner; per learner {[round(r, 4) for r in d['ratio_per_learner']]}); "
                     f"{d['tokens_per_s_on']:.0f} vs {d['tokens_per_s_off']:.0f} tokens/s in all")
        p = d.get("profile")
        if p:
            share = p["d2h_overlapped_share"]
            lines.append(f"- snapshot copies: {p['d2h_copies']} device-to-host copies, "
                         f"{p['d2h_us']:.0f} us, overlapped with compute: "
                         f"{'n/a' if share is None else f'{share:.1%}'}; host synchronisations: "
                         f"{json.dumps(p['host_syncs'])} ({p['note']})")
    else:
        lines.append(f"- throughput: {d}")
else:
    lines.append(f"- throughput: no result (exit {bench_rc}); see gpu_check.log")
sc = out / "shard_scaling.json"
if sc.exists():
    d = json.loads(sc.read_text())
    lines.append(f"- syncer shards ({d['cores']} cores, {d['learners']} learners): " + ", ".join(
        f"S = {r['S']}: {r['scaling']:.2f}x ({r['MB_per_s']:.0f} MB/s, target {r['target']:.1f})"
        for r in d["rows"]))
(out / "gpu_check.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
