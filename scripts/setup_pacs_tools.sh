#!/usr/bin/env bash
# The DICOM tools hilum-pacs is checked against, none of them written by Hilum:
#   - Debian's dicom3tools (dciodvfy: IOD validation), dcmtk (dsrdump, storescu, findscu, ...),
#     orthanc and orthanc-dicomweb (the reference PACS), installed with apt-get when missing;
#   - highdicom and pydicom, pinned in scripts/requirements-pacs.txt, in the venv
#     scripts/.venv-pacs (read by scripts/pacs_check.py).
# Prints on stdout
#   export HILUM_PACS_PYTHON=/abs/path/scripts/.venv-pacs/bin/python
# for the tests (crates/hilum-pacs/tests); progress goes to stderr. Idempotent.
#
# Installing orthanc tries to start its service, which containers refuse ("policy-rc.d
# denied"): that is expected; what counts is that the binaries are there afterwards.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

log() { echo "setup_pacs_tools: $*" >&2; }

orthanc_bin() { command -v Orthanc 2>/dev/null || { [ -x /usr/sbin/Orthanc ] && echo /usr/sbin/Orthanc; } || true; }
dicomweb_plugin=/usr/share/orthanc/plugins/libOrthancDicomWeb.so

missing=()
command -v dciodvfy >/dev/null 2>&1 || missing+=(dicom3tools)
command -v dsrdump >/dev/null 2>&1 || missing+=(dcmtk)
[ -n "$(orthanc_bin)" ] || missing+=(orthanc)
[ -f "$dicomweb_plugin" ] || missing+=(orthanc-dicomweb)

if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        log "error: ${missing[*]} missing and apt-get cannot run here (not root, no sudo): install them with apt-get install ${missing[*]}"
        exit 1
    fi
    command -v apt-get >/dev/null 2>&1 || { log "error: ${missing[*]} missing and this is not a Debian system: install them with your package manager"; exit 1; }
    log "installing Debian's ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq >&2
    if ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
        log "apt-get reported an error (orthanc's service start is refused in containers); checking the binaries"
    fi
fi

for tool in dciodvfy dsrdump storescu; do
    command -v "$tool" >/dev/null 2>&1 || { log "error: $tool is still missing after apt-get"; exit 1; }
done
[ -n "$(orthanc_bin)" ] || { log "error: the Orthanc binary is still missing after apt-get install orthanc"; exit 1; }
[ -f "$dicomweb_plugin" ] || { log "error: $dicomweb_plugin is still missing after apt-get install orthanc-dicomweb"; exit 1; }

venv="$here/.venv-pacs"
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements-pacs.txt" >&2
"$venv/bin/python" -c "import highdicom, pydicom; print('setup_pacs_tools: highdicom', highdicom.__version__, 'pydicom', pydicom.__version__)" >&2
echo "export HILUM_PACS_PYTHON=$venv/bin/python"
