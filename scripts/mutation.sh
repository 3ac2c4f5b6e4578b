#!/usr/bin/env bash
# Mutation testing (mutmut) of the modules whose tests are fast and direct, one module at a time,
# each against its own narrow tests; prints a score per module. Not part of scripts/test.sh or CI.
# How to read the result and what to do about a surviving mutant: docs/mutation.md.
#
#   bash scripts/mutation.sh                     # every module below
#   bash scripts/mutation.sh deadlines slot_table
#   bash scripts/mutation.sh --list              # the modules, their files and tests
#
# Everything happens in a copy of the working tree under a temp directory (printed at the end, kept
# so that `mutmut show NAME` works there): the repository itself is left as it was.
# Environment: PYTHON (default python3, with the project installed: bash scripts/install.sh),
# MUTATION_JOBS (parallel mutants, default: CPU count), MUTATION_WORKDIR (default: a new temp dir),
# MUTATION_VENV (where mutmut is installed when PYTHON lacks it), MUTATION_KEEP=0 (delete the work dir).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
MUTMUT_VERSION=3.8.1
JOBS=${MUTATION_JOBS:-$(nproc 2>/dev/null || echo 2)}

# name | file to mutate | pytest arguments that select its tests, separated by ';'
# Only tests that run in seconds and need no vLLM engine, speech stage or server.
MODULES=(
    "deadlines|omni_engine/deadlines.py|tests/test_deadlines.py;tests/test_deadlines_units.py;-m;not tts"
    "playback_clock|omni_engine/pipeline/playback_clock.py|tests/test_deadlines.py;tests/test_deadlines_units.py;-m;not tts"
    "slot_table|omni_engine/logits/slot_table.py|tests/test_logits_units.py;tests/test_slot_table_units.py"
    "api_key_auth|omni_engine/entrypoints/openai/auth.py|tests/test_api_key_auth_units.py"
    "queue_security|omni_engine/transfer_queue/security.py|tests/test_transfer_queue_security_units.py"
    "wire_headers|omni_engine/wire/headers.py|tests/test_stage_serialization.py;tests/test_wire_units.py"
    "stage_decoder|omni_engine/wire/stage_decoder.py|tests/test_stage_serialization.py;tests/test_wire_units.py"
    "stage_checks|omni_engine/config/stage_checks.py|tests/test_config.py;tests/test_config_checks_units.py;-k;not ray_is_imported"
    "pipeline_checks|omni_engine/config/pipeline_checks.py|tests/test_config.py;tests/test_config_checks_units.py;-k;not ray_is_imported"
)

names=()
for entry in "${MODULES[@]}"; do names+=("${entry%%|*}"); done

if [[ ${1:-} == --list || ${1:-} == -h || ${1:-} == --help ]]; then
    for entry in "${MODULES[@]}"; do
        IFS='|' read -r name file tests <<<"$entry"
        printf '%-16s %-42s %s\n' "$name" "$file" "${tests//;/ }"
    done
    exit 0
fi
selected=("$@")
[[ ${#selected[@]} -gt 0 ]] || selected=("${names[@]}")
for name in "${selected[@]}"; do
    if [[ " ${names[*]} " != *" $name "* ]]; then
        echo "unknown module '$name'; one of: ${names[*]}" >&2
        exit 2
    fi
done

# mutmut: the one in PYTHON if it is this version, else a venv of its own that sees PYTHON's packages
# (the project and its test tools) without adding anything to them.
if [[ $("$PY" -c 'import importlib.metadata as m; print(m.version("mutmut"))' 2>/dev/null || true) == "$MUTMUT_VERSION" ]]; then
    MPY=$PY
else
    VENV=${MUTATION_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/omni_engine/mutmut-$MUTMUT_VERSION}
    if ! "$VENV/bin/python" -c 'import mutmut' 2>/dev/null; then
        echo "installing mutmut $MUTMUT_VERSION into $VENV" >&2
        "$PY" -m venv --system-site-packages "$VENV"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "mutmut==$MUTMUT_VERSION"
    fi
    MPY=$VENV/bin/python
fi
"$MPY" -c 'import omni_engine, pytest' || { echo "the project is not installed in $PY: bash scripts/install.sh" >&2; exit 1; }

WORK=${MUTATION_WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/omni-mutation.XXXXXX")}
mkdir -p "$WORK"
SUMMARY=$WORK/summary.tsv
: >"$SUMMARY"

# A copy of the working tree (tracked and untracked files, not the ignored ones): what is tested is
# what is on disk, committed or not.
copy_tree() {
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard) |
        "$PY" -c '
import os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for rel in sys.stdin.buffer.read().decode().split("\0"):
    if rel and os.path.isfile(os.path.join(src, rel)):
        os.makedirs(os.path.dirname(os.path.join(dst, rel)) or dst, exist_ok=True)
        shutil.copy2(os.path.join(src, rel), os.path.join(dst, rel))
' "$REPO" "$1"
}

toml_list() {  # 'a;b c' -> ["a", "b c"]
    "$PY" -c 'import json, sys; print(json.dumps([a for a in sys.argv[1].split(";") if a]))' "$1"
}

run_module() {
    local name=$1 file=$2 tests=$3 dir=$WORK/$1 start
    rm -rf "$dir"
    mkdir -p "$dir"
    copy_tree "$dir"
    # mutmut reads [tool.mutmut] from pyproject.toml: only the copy's gets it.
    cat >>"$dir/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["omni_engine"]
only_mutate = ["$file"]
also_copy = ["stage_configs", "examples"]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
pytest_add_cli_args_test_selection = $(toml_list "$tests")
EOF
    echo "== $name: $file (tests: ${tests//;/ })"
    start=$(date +%s)
    if ! (cd "$dir" && "$MPY" -c 'import sys; from mutmut.__main__ import cli; sys.argv[0] = "mutmut"; cli()' \
            run --max-children "$JOBS") >"$dir/mutmut.log" 2>&1; then
        echo "mutmut failed on $name; the end of $dir/mutmut.log:" >&2
        tail -c 3000 "$dir/mutmut.log" | tr '\r' '\n' | tail -40 >&2
        return 1
    fi
    (cd "$dir" && "$MPY" - "$name" "$file" "$(($(date +%s) - start))" "$SUMMARY") <<'EOF'
import json, sys
from collections import Counter
from mutmut.stats import status_by_exit_code

name, path, seconds, summary = sys.argv[1:]
with open(f"mutants/{path}.meta") as f:
    codes = json.load(f)["exit_code_by_key"]
status = {key: status_by_exit_code[code] for key, code in codes.items()}
count = Counter(status.values())
total = len(status)
killed, timeout = count["killed"], count["timeout"]
survived = count["survived"] + count["no tests"]
other = total - killed - timeout - survived
score = 100.0 * (killed + timeout) / total if total else 0.0
with open(summary, "a") as f:
    f.write(f"{name}\t{total}\t{killed}\t{survived}\t{timeout}\t{other}\t{score:.1f}\t{seconds}\n")
left = sorted(k for k, s in status.items() if s not in ("killed", "timeout"))
for key in left:
    print(f"   {status[key]:<10} {key}")
if total and not killed:
    print(f"   WARNING: no mutant of {path} was killed: are its tests really importing the mutated copy?")
EOF
}

failed=()
for name in "${selected[@]}"; do
    for entry in "${MODULES[@]}"; do
        IFS='|' read -r mname file tests <<<"$entry"
        [[ $mname == "$name" ]] && { run_module "$mname" "$file" "$tests" || failed+=("$mname"); }
    done
done

echo
echo "mutmut $MUTMUT_VERSION, $(date -u +%Y-%m-%d), score = (killed + timeout) / mutants"
"$PY" - "$SUMMARY" <<'EOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
head = ["module", "mutants", "killed", "survived", "timeout", "suspicious", "score %", "wall s"]
width = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
line = lambda cells: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, width))) + " |"
print(line(head))
print("|" + "|".join("-" * (w + 2) for w in width) + "|")
for r in rows:
    print(line(r))
EOF
echo
echo "work dir: $WORK (per module: cd $WORK/<module> && $MPY -m mutmut show <mutant name>)"
if [[ ${MUTATION_KEEP:-1} == 0 ]]; then rm -rf "$WORK"; fi
[[ ${#failed[@]} -eq 0 ]] || { echo "failed: ${failed[*]}" >&2; exit 1; }
