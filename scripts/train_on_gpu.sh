#!/usr/bin/env bash
# One device call on an H200: train the quality checkpoint, then a short evaluation, the redundancy
# report and a calibration of it. Everything lands under $OUT in at most 8 files (what the device
# tool returns):
#   ckpt/{config.json, model.safetensors, train_log.txt, command.txt}   the checkpoint (HF layout,
#                    BF16 weights: 10 MiB, under the tool's 16 MiB per file; a model over 15 MiB is
#                    saved as model-0000i-of-0000n.safetensors + model.safetensors.index.json, and
#                    those files count towards the 8)
#   report.md        markdown: training summary, redundancy, calibration, quality table
#   results.json     the same as JSON (per-document / per-trial raw numbers included)
#   calibrated_config.json   flat FlashLoopConfig from the calibration
#   run.log          everything printed
# Needs only torch (+ safetensors, present on the GPU image) and the interpreter's stdlib source.
#
# Time plan on one H200 (wall, machine start excluded; each phase also has a hard timeout):
#   train 270 s (the first ~60 s are torch.compile's) + ~15 s loading/saving; redundancy ~15 s;
#   calibration ~15 s; eval: configs in priority order until its 170 s budget is used (the rest is
#   listed as skipped; run `flashloop-compile eval --configs full` separately for the whole table).
#   Total about 8.5 minutes.
#
#   bash scripts/train_on_gpu.sh                            # writes under $OUT (the device tool sets it)
#   TRAIN_SECONDS=60 EVAL_SECONDS=40 bash scripts/train_on_gpu.sh   # smoke run
#   EVAL_ENGINE=compiled bash scripts/train_on_gpu.sh               # evaluate through the compiled engines
#
# Training longer than one call (docs/QUALITY.md, "Training across calls"): a resumable run needs
# MAX_STEPS (the LR schedule spans it; TRAIN_SECONDS is then one call's wall budget) and also
# writes ckpt/train_state.json + ckpt/train_state-0000N.safetensors (BF16 weights and AdamW
# moments in shards of at most 15 MiB: the default shape's are 30 MiB in 3 shards, 40 MiB with
# model.safetensors, under the 48 MiB a call can carry in beside the repository). With the 4
# checkpoint files that is 8 files, all the device tool returns, so such a call is TRAIN_ONLY (the default
# when RESUMABLE=1 or RESUME is set): no redundancy, calibration or eval, only ckpt/ under $OUT,
# run.log not written there (its output is the call's output), TRAIN_SECONDS 420 by default
# (~60 s of it torch.compile's, paid again every call). Copy the returned ckpt/ into the
# git-ignored out/resume/ and carry it into the next call:
#   RESUMABLE=1 MAX_STEPS=8000 bash scripts/train_on_gpu.sh        # first call
#   RESUME=out/resume MAX_STEPS=8000 bash scripts/train_on_gpu.sh  # each later call (carry: out/resume)
#   RESUME=out/resume MAX_STEPS=8000 TRAIN_ONLY=0 TRAIN_SECONDS=200 bash scripts/train_on_gpu.sh
#       # last call: finish, then redundancy, calibration and eval; the state files are left out of
#       # $OUT (4 ckpt files + report.md, results.json, calibrated_config.json, run.log = 8)
# The options (shape, data, MAX_STEPS) must be the same in every call; only TRAIN_SECONDS, the
# log/eval intervals and DEVICE may change.
#
# STATE_DIR=out/train-state keeps the resumable state on the machine instead: training writes to and
# resumes from STATE_DIR (git-ignored, so a warm machine keeps it between calls that follow each
# other within its idle release; a fresh machine starts over), nothing of the state travels and no
# size cap applies, and only the checkpoint files are copied to $OUT/ckpt (weights over 15 MiB in
# shards). For a model larger than what a call can carry (about 6.3 M parameters), trained over
# back-to-back calls of one lease:
#   STATE_DIR=out/train-state MAX_STEPS=20000 LAYERS=8 HIDDEN=512 bash scripts/train_on_gpu.sh   # every call
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/quality}
RESUME=${RESUME:-}
RESUMABLE=${RESUMABLE:-0}
STATE_DIR=${STATE_DIR:-}
if [ -n "$STATE_DIR" ]; then
  RESUMABLE=1
  if [ -f "$STATE_DIR/train_state.json" ]; then RESUME=$STATE_DIR
  else echo "=== no state in $STATE_DIR (a fresh machine, or the first call): training starts at step 0"; fi
fi
[ -n "$RESUME" ] && RESUMABLE=1
MAX_STEPS=${MAX_STEPS:-}
TRAIN_ONLY=${TRAIN_ONLY:-$RESUMABLE}
if [ "$TRAIN_ONLY" = 1 ]; then TRAIN_SECONDS=${TRAIN_SECONDS:-420}; else TRAIN_SECONDS=${TRAIN_SECONDS:-270}; fi
LAYERS=${LAYERS:-6}
HIDDEN=${HIDDEN:-256}
SEQ_LEN=${SEQ_LEN:-1024}
BATCH=${BATCH:-64}
LR=${LR:-2e-3}
COMPILE=${COMPILE:---compile}
EVAL_DOCS=${EVAL_DOCS:-16}
EVAL_TRIALS=${EVAL_TRIALS:-8}
EVAL_CONFIGS=${EVAL_CONFIGS:-default}
EVAL_SECONDS=${EVAL_SECONDS:-170}
EVAL_ENGINE=${EVAL_ENGINE:-reference}   # compiled: each config's compiled engine (compiles first: fewer configs fit)
EVAL_EXTRA_CONFIGS=${EVAL_EXTRA_CONFIGS-all-on@window=256 all-on@retention=0.5/0.25 all-on@key_fraction=0.25 tsp+sda}  # empty: none
REDUNDANCY_SEQS=${REDUNDANCY_SEQS:-8}
CALIBRATION_SEQS=${CALIBRATION_SEQS:-16}
ANALYSIS_LEN=${ANALYSIS_LEN:-1024}      # tokens per redundancy / calibration sequence
CONTEXTS=${CONTEXTS:-1024,2048}         # perplexity contexts: the trained one and 2x
RETRIEVAL_CONTEXT=${RETRIEVAL_CONTEXT:-1024}
DEVICE=${DEVICE:-cuda}
TRAIN_EXTRA=${TRAIN_EXTRA:-}
PACKAGES=${PACKAGES:-}                  # e.g. "torch triton sympy": joins the train corpus and eval's held-out files
PKG_ARGS=()
[ -n "$PACKAGES" ] && PKG_ARGS=(--packages $PACKAGES)
RESUME_ARGS=()
[ -n "$MAX_STEPS" ] && RESUME_ARGS+=(--max-steps "$MAX_STEPS")
[ "$RESUMABLE" = 1 ] && RESUME_ARGS+=(--resumable)
[ -n "$RESUME" ] && RESUME_ARGS+=(--resume "$RESUME")
[ -n "$STATE_DIR" ] && RESUME_ARGS+=(--state-cap-mib 1000000)  # the state stays on this machine
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
CK="$OUT/ckpt"
TRAIN_OUT=${STATE_DIR:-$CK}
TMP=$(mktemp -d)
PY=${PYTHON:-python3}
CLI="$PY -m flashloop_compile.cli"

merge() {  # results.json and report.md from whatever parts exist so far (a timeout keeps them)
  $PY - "$OUT" "$TMP" "$CK" <<'EOF'
import json, sys
from pathlib import Path
out, tmp, ck = map(Path, sys.argv[1:])
res, md = {}, ["# Quality run", ""]
log = ck / "train_log.txt"
if log.is_file():
    lines = log.read_text().splitlines()
    # the last summary: a resumed run's log begins with the earlier calls'
    summary = next((json.loads(l[len("summary: "):]) for l in reversed(lines) if l.startswith("summary: ")), None)
    res["train"] = summary
    md += ["## Training", "", "```"] + [l for l in lines if l.startswith(("command:", "python", "corpus:", "unigram", "parameters:", "done:", "saved weights:", "held-out", "saved:"))] + ["```", ""]
for part in ("redundancy", "calibration", "eval"):
    j, m = tmp / f"{part}.json", tmp / f"{part}.md"
    if j.is_file():
        res[part] = json.loads(j.read_text())
    if m.is_file():
        md += [m.read_text(), ""]
(out / "results.json").write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")
(out / "report.md").write_text("\n".join(md) + "\n")
EOF
}

step() {  # step NAME COMMAND...: run, time, keep going on failure
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" || echo "=== $name FAILED (exit $?)"
  echo "=== $name took $((SECONDS - t0)) s"
  [ "$TRAIN_ONLY" = 1 ] || merge
}
LOG="$OUT/run.log"
[ "$TRAIN_ONLY" = 1 ] && LOG="$TMP/run.log"  # only ckpt/ comes back: the call's output holds the log

{
  echo "=== $(date -u) $(hostname); $($PY -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))')"
  step train timeout $((${TRAIN_SECONDS%.*} + 150)) $CLI train --out "$TRAIN_OUT" --seconds "$TRAIN_SECONDS" --layers "$LAYERS" --hidden "$HIDDEN" \
    --seq-len "$SEQ_LEN" --batch "$BATCH" --lr "$LR" $COMPILE --device "$DEVICE" ${RESUME_ARGS[@]+"${RESUME_ARGS[@]}"} \
    ${PKG_ARGS[@]+"${PKG_ARGS[@]}"} $TRAIN_EXTRA
  if [ -n "$STATE_DIR" ]; then  # the checkpoint travels, the state stays
    mkdir -p "$CK"
    for f in "$STATE_DIR"/*; do
      case "$(basename "$f")" in train_state*) ;; *) cp "$f" "$CK/" ;; esac
    done
  fi
  if [ "$TRAIN_ONLY" = 1 ]; then
    echo "=== TRAIN_ONLY: $(find "$OUT" -type f | wc -l) files under $OUT (the device tool returns 8):"
    ls -l "$CK"
  elif [ -f "$CK/model.safetensors" ] || [ -f "$CK/model.safetensors.index.json" ]; then
    if [ "$RESUMABLE" = 1 ]; then  # 8 files: 4 checkpoint + 4 reports; the state stays behind
      mkdir -p "$TMP/state" && mv "$CK"/train_state* "$TMP/state/" 2>/dev/null
      echo "=== the resumable state is left out of \$OUT (run TRAIN_ONLY=1 to continue training instead)"
    fi
    step redundancy timeout 90 $CLI redundancy --checkpoint "$CK" --device "$DEVICE" --seqs "$REDUNDANCY_SEQS" --seq-len "$ANALYSIS_LEN" \
      --json "$TMP/redundancy.json" --markdown "$TMP/redundancy.md"
    step calibration timeout 90 $CLI calibrate --checkpoint "$CK" --device "$DEVICE" --seqs "$CALIBRATION_SEQS" --seq-len "$ANALYSIS_LEN" \
      --threshold 0.05 --out "$OUT/calibrated_config.json" --json "$TMP/calibration.json" --markdown "$TMP/calibration.md"
    CAL=""
    [ -f "$OUT/calibrated_config.json" ] && CAL="$OUT/calibrated_config.json"
    step eval timeout $((${EVAL_SECONDS%.*} + 60)) $CLI eval --checkpoint "$CK" --device "$DEVICE" \
      --configs $EVAL_CONFIGS $CAL $EVAL_EXTRA_CONFIGS --max-seconds "$EVAL_SECONDS" --docs "$EVAL_DOCS" \
      --contexts "$CONTEXTS" --continuation 32 --retrieval-context "$RETRIEVAL_CONTEXT" --depths 0.1,0.5,0.9 --trials "$EVAL_TRIALS" \
      --engine "$EVAL_ENGINE" ${PKG_ARGS[@]+"${PKG_ARGS[@]}"} --json "$TMP/eval.json" --markdown "$TMP/eval.md"
  fi
  echo "=== done in $SECONDS s"
} 2>&1 | tee "$LOG"
