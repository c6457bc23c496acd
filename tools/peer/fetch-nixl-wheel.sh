#!/bin/bash
# Fetches NVIDIA NIXL's own Python wheel (nixl-cu13, CPython 3.12, x86-64) for the
# side-by-side comparison that tools/peer/compare.sh runs on the GPU machine, which has
# no network. Run it here, on any x86-64 or other machine with PyPI access:
#
#   bash tools/peer/fetch-nixl-wheel.sh            # -> .peer/nixl_cu13-1.5.1-...whl
#
# The wheel is 59 MB, 95 MB of it (unpacked) the `nixl_ep_cu13` expert-parallel package
# that the comparison never imports: it is dropped, RECORD is rewritten to match, and the
# rest is repacked as a wheel of about 30 MB under .peer/ at the repository root (listed
# in .git/info/exclude, so it is never committed but still travels with the working
# tree). The wheel's Requires-Dist are checked: torch and numpy come with the GPU
# machine's Python; any other requirement is downloaded to .peer/deps/.
#
# Environment: NIXL_VERSION (default 1.5.1), NIXL_PACKAGE (default nixl-cu13),
# PY_VERSION (default 3.12), PIP (default "python3 -m pip").
set -euo pipefail

version="${NIXL_VERSION:-1.5.1}"
package="${NIXL_PACKAGE:-nixl-cu13}"
py="${PY_VERSION:-3.12}"
pip="${PIP:-python3 -m pip}"
root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
dest="$root/.peer"
# Requirements the GPU machine's Python already has (torch 2.11 with numpy).
provided="torch numpy"

mkdir -p "$dest"
exclude="$(git -C "$root" rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.peer/' "$exclude" 2>/dev/null || echo '/.peer/' >>"$exclude"

work="$(mktemp -d "${TMPDIR:-/tmp}/nixl-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

wheel=''
for platform in manylinux_2_28_x86_64 manylinux_2_34_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64; do
    echo "fetch-nixl-wheel: trying $package==$version for cp${py/./} $platform"
    if $pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
        --implementation cp --platform "$platform" -d "$work/dl" "$package==$version"; then
        wheel="$(ls "$work"/dl/*.whl | head -n 1)"
        break
    fi
done
[ -n "$wheel" ] || { echo "fetch-nixl-wheel: no $package==$version wheel for cp${py/./} x86-64" >&2; exit 1; }
echo "fetch-nixl-wheel: got $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

python3 - "$wheel" "$dest" "$provided" <<'PY'
import base64, hashlib, os, re, sys, zipfile

src, dest, provided = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
DROP = "nixl_ep_"  # the expert-parallel package: nixl_ep_cu13/ (and its .libs, if any)

out = os.path.join(dest, os.path.basename(src))
with zipfile.ZipFile(src) as zin:
    names = zin.namelist()
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    kept = [n for n in names if not n.startswith(DROP) and n != record]
    dropped = [n for n in names if n.startswith(DROP)]
    dropped_bytes = sum(zin.getinfo(n).file_size for n in dropped)
    lines = [l for l in zin.read(record).decode().splitlines() if l and not l.startswith(DROP)]
    tmp = out + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        for n in kept:
            info = zin.getinfo(n)
            zout.writestr(info, zin.read(n), compress_type=zipfile.ZIP_DEFLATED)
        zout.writestr(record, "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, out)
    requires = [l.split(":", 1)[1].strip() for l in zin.read(metadata).decode().splitlines()
                if l.startswith("Requires-Dist:")]

# RECORD must list exactly what the wheel holds, with matching hashes (pip checks).
with zipfile.ZipFile(out) as z:
    record_lines = z.read(record).decode().splitlines()
    listed = {l.rsplit(",", 2)[0]: l.rsplit(",", 2)[1] for l in record_lines if l}
    for n in z.namelist():
        if n == record:
            continue
        digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(z.read(n)).digest()).rstrip(b"=").decode()
        assert listed.get(n) == digest, f"RECORD mismatch for {n}"
    assert not [n for n in z.namelist() if n.startswith(DROP)]

print(f"fetch-nixl-wheel: dropped {len(dropped)} files of {DROP}* ({dropped_bytes / 1e6:.0f} MB unpacked)")
print(f"fetch-nixl-wheel: {out}: {os.path.getsize(out) / 1e6:.1f} MB")
extra = []
for req in requires:
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    marker = req.split(";", 1)[1].strip() if ";" in req else ""
    if "extra ==" in marker:
        continue  # optional extras are never needed by the comparison
    if name in provided:
        print(f"fetch-nixl-wheel: requires {req}: provided by the GPU machine's Python")
    else:
        extra.append(req)
with open(os.path.join(dest, "extra-requirements.txt"), "w") as f:
    f.write("".join(r + "\n" for r in extra))
PY

rm -rf "$dest/deps"
if [ -s "$dest/extra-requirements.txt" ]; then
    echo "fetch-nixl-wheel: fetching what the GPU machine lacks: $(tr '\n' ' ' <"$dest/extra-requirements.txt")"
    $pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform any \
        -d "$dest/deps" -r "$dest/extra-requirements.txt"
    ls -la "$dest/deps"
else
    echo "fetch-nixl-wheel: no requirement beyond torch and numpy"
fi
# Keep only the newest repacked wheel of this package.
find "$dest" -maxdepth 1 -name "${package//-/_}-*.whl" ! -name "$(basename "$wheel")" -delete
echo "fetch-nixl-wheel: .peer/ holds $(du -sh "$dest" | cut -f1): $(cd "$dest" && ls | tr '\n' ' ')"
