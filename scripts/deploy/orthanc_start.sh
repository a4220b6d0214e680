#!/usr/bin/env bash
# Starts a throw-away Orthanc (Debian's orthanc 1.10.1 + orthanc-dicomweb) on 127.0.0.1, for the
# DICOMweb tests (crates/hilum-pacs/tests/dicomweb.rs) and for trying `hilum pacs pull` by hand:
#
#   eval "$(scripts/deploy/orthanc_start.sh)"          # or: source scripts/deploy/orthanc_start.sh
#   curl "$HILUM_ORTHANC_URL/system"
#   kill "$HILUM_ORTHANC_PID"                   # stops it; rm -rf "$HILUM_ORTHANC_WORK" clears it
#
# Usage: scripts/deploy/orthanc_start.sh [PARENT_DIR]
#   The storage, the index, the config and orthanc.log go in a new folder under PARENT_DIR
#   (default: target/ in the repository). HTTP and DICOM ports are free ports picked at random;
#   RemoteAccessAllowed is false and AuthenticationEnabled false (127.0.0.1 only), AE title ORTHANC,
#   DICOMweb at /dicom-web/, OverwriteInstances true (a resend replaces, as Hilum's results expect).
#   HILUM_ORTHANC_USER=user:password turns HTTP basic authentication on with that one user.
#   HILUM_ORTHANC_BIN=/path/to/Orthanc uses that binary (default: Orthanc on PATH, /usr/sbin).
#   HILUM_ORTHANC_MODALITY=AE@HOST:PORT declares that DICOM peer as modality `hilum` (routing).
# Prints on stdout, once `GET /system` answers:
#   export HILUM_ORTHANC_URL=http://127.0.0.1:PORT        (DICOMweb: $HILUM_ORTHANC_URL/dicom-web)
#   export HILUM_ORTHANC_DICOM_PORT=PORT
#   export HILUM_ORTHANC_PID=PID
#   export HILUM_ORTHANC_WORK=DIR
# Progress and errors go to stderr. Orthanc missing: `bash scripts/setup_pacs_tools.sh` installs it.

_hilum_orthanc_start() {
    local root parent work bin plugin http dicom pid try i auth modalities
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    parent="${1:-$root/target}"
    plugin=/usr/share/orthanc/plugins/libOrthancDicomWeb.so
    if [ -n "${HILUM_ORTHANC_BIN:-}" ]; then
        bin="$(command -v "$HILUM_ORTHANC_BIN" 2>/dev/null || true)"
    else
        bin="$(command -v Orthanc 2>/dev/null || true)"
        [ -z "$bin" ] && [ -x /usr/sbin/Orthanc ] && bin=/usr/sbin/Orthanc
    fi
    if [ -z "$bin" ] || [ ! -f "$plugin" ]; then
        echo "orthanc_start: Orthanc (${HILUM_ORTHANC_BIN:-Orthanc}) or its DICOMweb plugin ($plugin) is missing: run bash scripts/setup_pacs_tools.sh" >&2
        return 1
    fi
    mkdir -p "$parent" || return 1
    work="$(mktemp -d "$parent/orthanc.XXXXXX")" || return 1
    auth='"AuthenticationEnabled": false,'
    if [ -n "${HILUM_ORTHANC_USER:-}" ]; then
        case "$HILUM_ORTHANC_USER" in
            *:*) ;;
            *) echo "orthanc_start: HILUM_ORTHANC_USER is user:password" >&2; return 1 ;;
        esac
        auth="\"AuthenticationEnabled\": true, \"RegisteredUsers\": { $(python3 -c 'import json,sys; u,p=sys.argv[1].split(":",1); print(json.dumps(u)+": "+json.dumps(p))' "$HILUM_ORTHANC_USER") },"
    fi
    # HILUM_ORTHANC_MODALITY=AE@HOST:PORT declares a DICOM peer Orthanc may send studies to
    # (`POST /modalities/hilum/store`), e.g. Hilum's DICOM node.
    modalities=""
    if [ -n "${HILUM_ORTHANC_MODALITY:-}" ]; then
        modalities="\"DicomModalities\": { \"hilum\": $(python3 -c 'import json,sys; ae,rest=sys.argv[1].split("@",1); host,port=rest.rsplit(":",1); print(json.dumps([ae,host,int(port)]))' "$HILUM_ORTHANC_MODALITY") },"
    fi
    free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
    for try in 1 2 3; do
        http=$(free_port) && dicom=$(free_port) || return 1
        [ "$http" = "$dicom" ] && continue
        cat > "$work/orthanc.json" <<EOF
{
  "Name": "hilum-test",
  "StorageDirectory": "$work/storage",
  "IndexDirectory": "$work/index",
  "HttpPort": $http,
  "DicomPort": $dicom,
  "DicomAet": "ORTHANC",
  "RemoteAccessAllowed": false,
  $auth
  $modalities
  "OverwriteInstances": true,
  "HttpsCACertificates": "",
  "Plugins": ["$plugin"],
  "DicomWeb": { "Enable": true, "Root": "/dicom-web/" }
}
EOF
        # setsid and closed descriptors: the caller (a test reading this script's stdout) is not
        # kept waiting by Orthanc's inherited pipe.
        setsid "$bin" "$work/orthanc.json" < /dev/null > "$work/orthanc.log" 2>&1 &
        pid=$!
        for i in $(seq 1 300); do
            # Any HTTP answer (401 included, with authentication on) means it is up.
            if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/system")" != 000 ]; then
                echo "orthanc_start: Orthanc $pid on 127.0.0.1:$http (DICOM $dicom), files in $work" >&2
                echo "export HILUM_ORTHANC_URL=http://127.0.0.1:$http"
                echo "export HILUM_ORTHANC_DICOM_PORT=$dicom"
                echo "export HILUM_ORTHANC_PID=$pid"
                echo "export HILUM_ORTHANC_WORK=$work"
                export HILUM_ORTHANC_URL="http://127.0.0.1:$http" HILUM_ORTHANC_DICOM_PORT="$dicom" \
                    HILUM_ORTHANC_PID="$pid" HILUM_ORTHANC_WORK="$work"
                return 0
            fi
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill "$pid" 2>/dev/null
        echo "orthanc_start: Orthanc did not answer on port $http (try $try); its log:" >&2
        tail -n 20 "$work/orthanc.log" >&2
    done
    echo "orthanc_start: Orthanc did not start; see $work/orthanc.log" >&2
    return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    _hilum_orthanc_start "$@"
    exit $?
else
    _hilum_orthanc_start "$@"
fi
