#!/bin/sh
# install-agent.sh: install, upgrade or remove the gpumarket provider agent on a Linux host.
#
#   curl -fsSL https://MASTER/downloads/install-agent.sh | sh -s -- --master https://MASTER --token TOKEN
#
# Run `sh install-agent.sh --help` for the options. What goes where (defaults):
#
#   PREFIX/venv/                     a virtual environment holding the gpumarket package
#   PREFIX/bin/gpumarket-agent       runs the agent with PREFIX/etc/agent.toml (the unit's ExecStart)
#   PREFIX/etc/agent.toml            the agent's settings ([agent]: data_dir, gpus, zone, region)
#   PREFIX/etc/install.env           what this script installed (read by re-runs and --uninstall)
#   /var/lib/gpumarket-agent/        the host's key, certificate, identity and workloads, with
#                                    systemd (its StateDirectory=); PREFIX/state with --no-systemd
#   /etc/systemd/system/gpumarket-agent.service
#
# PREFIX is /opt/gpumarket-agent for root, else ~/.local/share/gpumarket-agent. Re-running the
# script upgrades in place: the package is reinstalled (kept when it is the very same wheel), the
# identity kept (no token needed) and the service restarted. A token the master would refuse stops
# a first install before anything is downloaded; a first install that fails later removes what it
# created.
#
# Everything runs from main, called on the last line, so that `curl … | sh` has read the whole
# script before any of it runs. The file lives in master/data/ as package data, so every master
# serves it (GET /downloads/install-agent.sh), from a checkout, a wheel or an image alike;
# deploy/install-agent.sh links to it.

set -eu

UNIT_NAME=gpumarket-agent.service
UNIT_FILE=/etc/systemd/system/$UNIT_NAME
SYSTEM_STATE_DIR=/var/lib/gpumarket-agent
DEFAULT_USER=gpumarket-agent
MIN_PYTHON=3.11
PACKAGE_SHA_FILE=gpumarket-package.sha256

usage() {
    cat <<'EOF'
Usage: install-agent.sh --master URL --token TOKEN [options]
       install-agent.sh --uninstall [--prefix DIR]
       install-agent.sh --print-unit [--prefix DIR] [--user NAME]

Installs the gpumarket provider agent: checks this host, installs the agent package from the
master into a virtual environment, enrolls the host with a one-time token from the console,
writes the agent's config, and installs and starts a hardened systemd service. Re-running it
upgrades the agent in place and keeps the host's identity (no token needed then).

Options:
  --master URL       the master, e.g. https://gpumarket.example (a re-run reuses the last one)
  --token TOKEN      one-time enrollment token (console: Enroll a host); only for a first install;
                     checked with the master (not used up) before anything is installed
  --zone ZONE        DNS zone with the relays' SRV records (written to the config)
  --region REGION    the region this host is in, one of the master's (GET /api/v1/regions):
                     its network is measured to that region's relay (checked before anything
                     is installed; written to the config)
  --gpus SPEC        GPU backend: nvml (default; needs the NVIDIA driver), sim:2xRTX4090 (a
                     simulated host, for trying things out) or replay:FILE
  --prefix DIR       where to install (default: /opt/gpumarket-agent as root,
                     else ~/.local/share/gpumarket-agent)
  --package WHEEL    install this gpumarket wheel (a file or an http(s) URL) instead of the
                     master's GET /downloads/agent
  --python PATH      Python 3.11 or newer to build the virtual environment with (default: the
                     first of python3, python3.14 ... python3.11 that is new enough)
  --user NAME        system user the agent runs as (default: gpumarket-agent, created if
                     missing; with --no-systemd: the invoking user unless given)
  --no-systemd       install and enroll, but start nothing: run PREFIX/bin/gpumarket-agent
                     yourself (no root needed)
  --uninstall        stop and remove the service, the prefix, the agent's state and the user
                     this script created
  --print-unit       print the systemd unit this script would install, and exit
  -h, --help         this text

Environment: PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS and the other PIP_* settings
apply to installing the package's dependencies.
EOF
}

say() { printf 'install-agent: %s\n' "$*"; }
warn() { printf 'install-agent: warning: %s\n' "$*" >&2; }
die() {
    printf 'install-agent: error: %s\n' "$*" >&2
    exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }

# A value as one single-quoted shell word: ' becomes '\''.
shell_quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
# A value as a TOML basic string: \ and " escaped.
toml_quote() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g')"; }

# ---- options ------------------------------------------------------------------------------

need_value() {
    # $1: the option, $2: how many arguments are left (itself included), $3: the next one.
    [ "$2" -ge 2 ] || die "$1 needs a value (see --help)"
    case $3 in
        --*) die "$1 needs a value, not the option '$3' (see --help)" ;;
    esac
}

one_line() {
    # $1: option, $2: its value. Values are written to files one per line: no line breaks.
    case $2 in
        *'
'*) die "$1 must not contain a line break" ;;
    esac
}

parse_options() {
    master="" token="" zone="" region="" gpus="" prefix="" package="" python="" agent_user=""
    systemd=yes
    action=install
    while [ $# -gt 0 ]; do
        case $1 in
            --master) need_value "$1" $# "${2-}"; master=$2; shift 2 ;;
            --master=*) master=${1#*=}; shift ;;
            --token) need_value "$1" $# "${2-}"; token=$2; shift 2 ;;
            --token=*) token=${1#*=}; shift ;;
            --zone) need_value "$1" $# "${2-}"; zone=$2; shift 2 ;;
            --zone=*) zone=${1#*=}; shift ;;
            --region) need_value "$1" $# "${2-}"; region=$2; shift 2 ;;
            --region=*) region=${1#*=}; shift ;;
            --gpus) need_value "$1" $# "${2-}"; gpus=$2; shift 2 ;;
            --gpus=*) gpus=${1#*=}; shift ;;
            --prefix) need_value "$1" $# "${2-}"; prefix=$2; shift 2 ;;
            --prefix=*) prefix=${1#*=}; shift ;;
            --package) need_value "$1" $# "${2-}"; package=$2; shift 2 ;;
            --package=*) package=${1#*=}; shift ;;
            --python) need_value "$1" $# "${2-}"; python=$2; shift 2 ;;
            --python=*) python=${1#*=}; shift ;;
            --user) need_value "$1" $# "${2-}"; agent_user=$2; shift 2 ;;
            --user=*) agent_user=${1#*=}; shift ;;
            --no-systemd) systemd=no; shift ;;
            --uninstall) action=uninstall; shift ;;
            --print-unit) action=print-unit; shift ;;
            -h | --help) usage; exit 0 ;;
            *) die "unknown option '$1' (see --help)" ;;
        esac
    done
    for pair in "--master:$master" "--token:$token" "--zone:$zone" "--region:$region" "--gpus:$gpus" "--prefix:$prefix" \
        "--package:$package" "--python:$python" "--user:$agent_user"; do
        one_line "${pair%%:*}" "${pair#*:}"
    done

    if [ -z "$prefix" ]; then
        if [ "$(id -u)" = 0 ]; then
            prefix=/opt/gpumarket-agent
        else
            prefix=${XDG_DATA_HOME:-$HOME/.local/share}/gpumarket-agent
        fi
    fi
    case $prefix in
        /*) ;;
        *) prefix=$(pwd)/$prefix ;;
    esac
    prefix=${prefix%/}
    [ -n "$prefix" ] || die "--prefix must not be /"
    record_file=$prefix/etc/install.env
    config_file=$prefix/etc/agent.toml
    wrapper=$prefix/bin/gpumarket-agent
    venv=$prefix/venv
}

# The value of KEY in the install record (key=value lines this script writes), or "".
recorded() {
    [ -f "$record_file" ] || return 0
    sed -n "s/^$1=//p" "$record_file" | tail -n 1
}

# ---- the systemd unit ---------------------------------------------------------------------

render_unit() {
    # $1: the user the agent runs as. Where a docker group exists, the agent joins it for its
    # container rentals (the engine's socket is root-equivalent: the agent's own hardening and
    # the rentals' isolation are what stand between renters and the host).
    docker_groups=
    if getent group docker >/dev/null 2>&1; then
        docker_groups="SupplementaryGroups=docker"
    fi
    cat <<EOF
# Written by install-agent.sh; re-run it to change this unit, or --uninstall to remove it.
[Unit]
Description=gpumarket provider agent
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
User=$1
Group=$1
# As root ("+"), before the agent: the firewall rules that keep container rentals off this
# host's services and link-local metadata; a failure ("-") leaves the agent reporting them off.
ExecStartPre=-+$venv/bin/gpumarket agent netguard --config $config_file
ExecStart=$wrapper
$docker_groups
Restart=on-failure
RestartSec=5
# Exit status 2 is a configuration problem (not enrolled, revoked, bad settings): restarting
# cannot fix it, and the log says what to do.
RestartPreventExitStatus=2
# Stopping or restarting the unit signals the agent alone: the workloads it started keep
# running and the next agent re-adopts them, so an upgrade does not end renters' work.
# --uninstall ends them first.
KillMode=process
TimeoutStopSec=30
# The agent may give each workload a cgroup of its own below the unit's.
Delegate=yes
StateDirectory=gpumarket-agent
StateDirectoryMode=0700
Environment=PYTHONUNBUFFERED=1
UMask=0077
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
# No PrivateDevices=, DeviceAllow= or ProtectClock= (which implies a device allow-list): the
# agent and its workloads need /dev/nvidia*.
RestrictSUIDSGID=yes
RestrictRealtime=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
EOF
}

# ---- removing -----------------------------------------------------------------------------

remove_user() {
    # $1: user name. Its group goes with it where the system made one of the same name.
    if have userdel; then
        userdel "$1" 2>/dev/null || warn "could not remove user $1; remove it with: userdel $1"
    elif have deluser; then
        deluser "$1" >/dev/null 2>&1 || warn "could not remove user $1; remove it with: deluser $1"
    fi
}

unit_is_ours() {
    [ -f "$UNIT_FILE" ] && grep -qxF "ExecStart=$wrapper" "$UNIT_FILE"
}

remove_unit() {
    [ -f "$UNIT_FILE" ] || return 0
    unit_is_ours || {
        warn "$UNIT_FILE runs another installation's agent; leaving it"
        return 0
    }
    if have systemctl; then
        # KillMode=process leaves workloads running when the agent stops: end them first.
        systemctl kill --kill-who=all --signal=SIGTERM "$UNIT_NAME" >/dev/null 2>&1 || true
        systemctl disable --now "$UNIT_NAME" >/dev/null 2>&1 || true
    fi
    rm -f "$UNIT_FILE"
    if have systemctl; then
        systemctl daemon-reload >/dev/null 2>&1 || true
        systemctl reset-failed "$UNIT_NAME" >/dev/null 2>&1 || true
    fi
    say "removed $UNIT_FILE"
}

# What this script puts in a prefix, then the prefix's folders where that leaves them empty
# (a prefix shared with other software keeps the rest). The state dir is not touched here.
remove_prefix_content() {
    rm -rf "$venv"
    rm -f "$wrapper" "$config_file" "$record_file"
    for dir in "$prefix/bin" "$prefix/etc" "$prefix"; do
        rmdir "$dir" 2>/dev/null || true
    done
}

uninstall() {
    if [ ! -f "$record_file" ]; then
        if [ -e "$wrapper" ] || [ -d "$venv" ]; then
            die "$prefix was not installed by this script (no $record_file); remove it by hand"
        fi
        say "nothing installed in $prefix"
        return 0
    fi
    if [ "$(recorded systemd)" = yes ] || unit_is_ours; then
        [ "$(id -u)" = 0 ] || die "removing the systemd service needs root: run this with sudo"
        remove_unit
    fi
    state_dir=$(recorded state_dir)
    host_id=$(sed -n 's/.*"host_id": *"\([^"]*\)".*/\1/p' "$state_dir/identity.json" 2>/dev/null || true)
    user_created=$(recorded user_created)
    agent_user=$(recorded agent_user)
    # Only the two places this script puts state.
    case $state_dir in
        "$SYSTEM_STATE_DIR" | "$prefix/state") rm -rf "$state_dir" ;;
        "") ;;
        *) warn "not removing $state_dir: this script does not put state there" ;;
    esac
    remove_prefix_content
    if [ "$user_created" = yes ] && [ -n "$agent_user" ]; then
        remove_user "$agent_user"
        say "removed user $agent_user"
    fi
    say "removed the gpumarket agent from $prefix"
    if [ -n "$host_id" ]; then
        say "host $host_id stays listed at the master (offline); revoke it there if it will not come back"
    fi
}

# ---- installing: what to do, and whether this host can -----------------------------------

settle_install() {
    upgrade=no
    [ -f "$record_file" ] && upgrade=yes
    [ -n "$master" ] || master=$(recorded master)
    [ -n "$gpus" ] || gpus=$(recorded gpus)
    [ -n "$gpus" ] || gpus=nvml
    [ -n "$zone" ] || zone=$(recorded zone)
    [ -n "$region" ] || region=$(recorded region)
    [ -n "$agent_user" ] || agent_user=$(recorded agent_user)

    [ -n "$master" ] || die "--master URL is required (the address of your gpumarket master, as in the console's one-liner)"
    case $master in
        http://?* | https://?*) master=${master%/} ;;
        *) die "--master must be an http:// or https:// URL, not '$master'" ;;
    esac
    case $token in
        *[[:space:]]*) die "--token must not contain spaces; copy it again from the console" ;;
    esac
    case $gpus in
        nvml | sim:?* | replay:?*) ;;
        *) die "--gpus must be nvml, sim:<N>x<MODEL> (e.g. sim:2xRTX4090) or replay:FILE, not '$gpus'" ;;
    esac

    if [ "$systemd" = yes ]; then
        state_dir=$SYSTEM_STATE_DIR
        [ -n "$agent_user" ] || agent_user=$DEFAULT_USER
    else
        state_dir=$prefix/state
        # Running as yourself needs no user of its own.
        [ "$agent_user" != "$(id -un)" ] || agent_user=""
    fi
    # An upgrade keeps the identity where the first install put it.
    if [ "$upgrade" = yes ] && [ -n "$(recorded state_dir)" ]; then
        state_dir=$(recorded state_dir)
    fi
    enrolled=no
    if [ -f "$state_dir/identity.json" ] && [ -f "$state_dir/key.pem" ]; then
        enrolled=yes
    fi
    if [ "$enrolled" = no ] && [ -z "$token" ]; then
        die "--token TOKEN is required to enroll this host: create one in the console (Enroll a host) or with POST /api/v1/enrollment-tokens"
    fi
}

python_ok() {
    "$1" -c "import sys; sys.exit(0 if sys.version_info >= ($(echo "$MIN_PYTHON" | tr . ,)) else 1)" 2>/dev/null
}

find_python() {
    if [ -n "$python" ]; then
        have "$python" || die "--python $python: no such program"
        python_ok "$python" || die "--python $python is older than Python $MIN_PYTHON; install python$MIN_PYTHON or newer"
    else
        for candidate in python3 python3.14 python3.13 python3.12 python3.11; do
            if have "$candidate" && python_ok "$candidate"; then
                python=$candidate
                break
            fi
        done
        if [ -z "$python" ]; then
            if have python3; then
                found=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "?")
                die "python3 is $found; the agent needs Python $MIN_PYTHON or newer: install it (e.g. apt-get install python3.11 python3.11-venv) and pass --python /usr/bin/python3.11"
            fi
            die "Python $MIN_PYTHON or newer is missing: install it (e.g. apt-get install python3 python3-venv, or dnf install python3.11) and run this again"
        fi
    fi
    "$python" -c 'import venv, ensurepip' 2>/dev/null || {
        version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        die "$python cannot create virtual environments (no venv/ensurepip): install it (e.g. apt-get install python$version-venv) and run this again"
    }
}

nvidia_driver_found() {
    have nvidia-smi && return 0
    for ldconfig in ldconfig /sbin/ldconfig /usr/sbin/ldconfig; do
        if have "$ldconfig" && "$ldconfig" -p 2>/dev/null | grep -q 'libnvidia-ml\.so\.1'; then
            return 0
        fi
    done
    return 1
}

check_host() {
    [ "$(uname -s)" = Linux ] || die "the gpumarket agent runs on Linux only (this is $(uname -s))"
    if [ "$systemd" = yes ] || [ -n "$agent_user" ]; then
        [ "$(id -u)" = 0 ] || die "installing the service and its user needs root: run this with sudo, or pass --no-systemd to install for the current user without a service"
    fi
    if [ "$systemd" = yes ] && { ! have systemctl || [ ! -d /run/systemd/system ]; }; then
        die "systemd is not running on this host: pass --no-systemd and start $wrapper from your init system"
    fi
    find_python
    if [ "$gpus" = nvml ] && ! nvidia_driver_found; then
        die "no NVIDIA driver found (neither nvidia-smi nor libnvidia-ml.so.1): install the NVIDIA driver (e.g. apt-get install nvidia-driver, or the .run installer from https://www.nvidia.com/drivers), check that nvidia-smi lists the GPUs, and run this again; to try the agent on a host without GPUs, pass --gpus sim:2xRTX4090"
    fi
    if have curl; then
        fetcher=curl
    elif have wget; then
        fetcher=wget
    else
        fetcher=""
    fi
}

# ---- installing: the package ---------------------------------------------------------------

header_value() {
    # $1: header dump, $2: header name (lower case). The last response's value, trimmed.
    tr -d '\r' <"$1" | awk -v name="$2" '
        { split($0, part, ":"); key = tolower(part[1]); sub(/^[[:space:]]+/, "", key) }
        key == name { value = $0; sub(/^[^:]*:[[:space:]]*/, "", value); sub(/[[:space:]]+$/, "", value) }
        END { print value }'
}

# request URL OUT HEADERS [BODY]: GET URL (with BODY, POST that JSON file) into OUT, its response headers into
# HEADERS and its HTTP status into $code; dies with a hint on a connection error.
request() {
    req_url=$1 req_out=$2 req_headers=$3 req_body=${4-}
    [ -n "$fetcher" ] || die "curl or wget is needed to reach $req_url: install one (e.g. apt-get install curl)"
    if [ -n "$req_body" ]; then
        failed="cannot reach $req_url"
    else
        failed="cannot download $req_url"
    fi
    if [ "$fetcher" = curl ]; then
        set --  # (a redirect keeps a POST a POST: curl's default turns it into a GET)
        [ -z "$req_body" ] || set -- --post301 --post302 -H 'Content-Type: application/json' --data-binary "@$req_body"
        code=$(curl -sS -L --proto '=http,https' --retry 2 --connect-timeout 15 -D "$req_headers" -o "$req_out" -w '%{http_code}' "$@" "$req_url") ||
            die "$failed: is the master's URL right and reachable from this host? (curl exit status $?)"
    else
        set --
        [ -z "$req_body" ] || set -- --header='Content-Type: application/json' --post-file="$req_body"
        wget -nv -S --content-on-error -O "$req_out" "$@" "$req_url" 2>"$req_headers" || grep -q 'HTTP/' "$req_headers" ||
            die "$failed: is the master's URL right and reachable from this host?"
        code=$(sed -n 's/^[[:space:]]*HTTP\/[0-9.]* \([0-9][0-9][0-9]\).*/\1/p' "$req_headers" | tail -n 1)
    fi
}

# The "message" of the master's error body (JSON) in file $1, or "".
message_of() {
    sed -n 's/.*"message": *"\([^"]*\)".*/\1/p' "$1" 2>/dev/null | head -n 1
}

# fetch URL OUT HEADERS: download URL to OUT and its response headers to HEADERS; dies with the
# server's message on an HTTP error, and with a hint on a connection error.
fetch() {
    request "$1" "$2" "$3"
    if [ "$code" != 200 ]; then
        message=$(message_of "$2")
        die "$1 answered HTTP ${code:-?}${message:+: $message}"
    fi
}

# Whether the master would enroll this host with --token (POST /api/v1/enroll/check: known, unused,
# unexpired), asked before anything is downloaded; the token stays unused. Enrolling checks again,
# as the token may be used or expire in between.
check_token() {
    url=$master/api/v1/enroll/check
    "$python" -c 'import json, sys; print(json.dumps({"token": sys.argv[1]}))' "$token" >"$work/token.json"
    request "$url" "$work/check.json" "$work/check.headers" "$work/token.json"
    message=$(message_of "$work/check.json")
    case $code in
        200)
            expires=$(sed -n 's/.*"expires_at": *"\([^"]*\)".*/\1/p' "$work/check.json")
            say "the master accepts the enrollment token (until ${expires:-?})"
            ;;
        403) die "the master refused enrollment: ${message:-HTTP 403}" ;;
        422) die "the master refused enrollment: ${message:-HTTP 422}; copy the token again from the console" ;;
        404 | 405) warn "$master does not check enrollment tokens beforehand (an older master?); enrolling will" ;;
        *) die "$url answered HTTP ${code:-?}${message:+: $message}" ;;
    esac
}

# The master's regions (GET /api/v1/regions: those of its live relays); --region must be one of them.
check_region() {
    fetch "$master/api/v1/regions" "$work/regions.json" "$work/regions.headers"
    # {"regions": ["eu-west", "us-east"]} -> eu-west us-east (region names hold no quotes or commas)
    known=$(sed -n 's/.*"regions": *\[\([^]]*\)\].*/\1/p' "$work/regions.json" | tr -d '" ' | tr ',' ' ')
    for one in $known; do
        [ "$one" != "$region" ] || return 0
    done
    [ -n "$known" ] || die "the master lists no regions (no relay is up): leave out --region, or retry once its relays run"
    die "unknown region '$region'; the master's regions: $(printf '%s' "$known" | sed 's/ /, /g')"
}

sha256_of() {
    if have sha256sum; then
        sha256sum "$1" | cut -d ' ' -f 1
    else
        "$python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"
    fi
}

valid_wheel_name() {
    case $1 in
        */* | *[!A-Za-z0-9._+-]*) return 1 ;;
        gpumarket-*.whl) return 0 ;;
        *) return 1 ;;
    esac
}

# Download (or copy) the package into $work and check it; sets $wheel, $wheel_name and $wheel_sha.
get_package() {
    expected_sha=""
    case $package in
        "")
            url=$master/downloads/agent
            say "downloading the agent package from $url"
            fetch "$url" "$work/download" "$work/headers"
            wheel_name=$(header_value "$work/headers" x-gpumarket-package)
            expected_sha=$(header_value "$work/headers" x-gpumarket-sha256)
            [ -n "$wheel_name" ] || die "$url did not name the package (no X-Gpumarket-Package header): is $master a gpumarket master?"
            ;;
        http://* | https://*)
            say "downloading the agent package from $package"
            fetch "$package" "$work/download" "$work/headers"
            wheel_name=$(header_value "$work/headers" x-gpumarket-package)
            expected_sha=$(header_value "$work/headers" x-gpumarket-sha256)
            if [ -z "$wheel_name" ]; then
                wheel_name=${package%%[?#]*}
                wheel_name=${wheel_name##*/}
            fi
            ;;
        *)
            [ -f "$package" ] || die "--package $package: no such file"
            wheel_name=${package##*/}
            cp "$package" "$work/download"
            ;;
    esac
    valid_wheel_name "$wheel_name" || die "the package must be a gpumarket wheel (gpumarket-<version>-....whl), not '$wheel_name'"
    wheel=$work/$wheel_name
    mv "$work/download" "$wheel"
    wheel_sha=$(sha256_of "$wheel")
    if [ -n "$expected_sha" ]; then
        [ "$wheel_sha" = "$expected_sha" ] ||
            die "the downloaded package is damaged: sha256 $wheel_sha, the master says $expected_sha; run this again"
        say "package $wheel_name verified (sha256 $wheel_sha)"
    fi
}

# ---- installing: files, enrollment, service --------------------------------------------------

# Undo a failed first install (an upgrade keeps what it had); always remove the work folder.
cleanup() {
    status=$?
    rm -rf "$work"
    [ "$finished" = no ] || return 0
    if [ "$upgrade" = no ]; then
        [ "$installed_unit" = no ] || remove_unit
        [ "$created_state" = no ] || rm -rf "$state_dir"
        if [ "$created_prefix" = yes ]; then
            rm -rf "$prefix"
        elif [ -d "$prefix" ]; then
            remove_prefix_content
        fi
        [ "$created_user" = no ] || remove_user "$agent_user"
        printf 'install-agent: nothing was installed (status %s)\n' "$status" >&2
    elif [ "$changing" = no ]; then
        printf 'install-agent: nothing was changed (status %s)\n' "$status" >&2
    else
        printf 'install-agent: the upgrade stopped (status %s); the host keeps its identity in %s: run this again to finish\n' \
            "$status" "$state_dir" >&2
    fi
}

create_user() {
    id "$agent_user" >/dev/null 2>&1 && return 0
    nologin=/usr/sbin/nologin
    [ -x "$nologin" ] || nologin=/sbin/nologin
    [ -x "$nologin" ] || nologin=/bin/false
    if have useradd; then
        useradd --system --user-group --home-dir "$state_dir" --no-create-home --shell "$nologin" \
            --comment "gpumarket provider agent" "$agent_user"
    elif have adduser; then
        adduser -S -D -H -h "$state_dir" -s "$nologin" "$agent_user"
    else
        die "cannot create user $agent_user (no useradd or adduser): create it yourself, then run this again"
    fi
    created_user=yes
    say "created system user $agent_user"
}

pip_install() {
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-input --quiet "$@"
}

# Install the package into the venv (created if missing or broken). The sha256 of the wheel installed last is kept
# in the venv (PACKAGE_SHA_FILE): a re-run with the very same wheel keeps it while it runs (gpumarket --version), as
# installing it again would put back the same files. Remove PREFIX/venv to have everything installed afresh.
install_package() {
    new_venv=no
    if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import sys' 2>/dev/null; }; then
        rm -rf "$venv"
        "$python" -m venv "$venv"
        new_venv=yes
    fi
    if [ "$(cat "$venv/$PACKAGE_SHA_FILE" 2>/dev/null)" = "$wheel_sha" ] && "$venv/bin/gpumarket" --version >/dev/null 2>&1; then
        say "$wheel_name is installed already (the same sha256); keeping it"
        return 0
    fi
    rm -f "$venv/$PACKAGE_SHA_FILE"
    say "installing $wheel_name and its dependencies into $venv"
    pip_install "$wheel"
    # The same version number may carry new code (a rebuilt wheel): replace the package itself too, unless the
    # venv is new (then it holds this wheel's package).
    [ "$new_venv" = yes ] || pip_install --no-deps --force-reinstall "$wheel"
    "$venv/bin/gpumarket" --version >/dev/null || die "the installed package does not run: $venv/bin/gpumarket --version failed"
    echo "$wheel_sha" >"$venv/$PACKAGE_SHA_FILE"
}

enroll() {
    [ -d "$state_dir" ] || created_state=yes
    mkdir -p "$state_dir"
    chmod 700 "$state_dir"
    if [ "$enrolled" = no ]; then
        say "enrolling this host with $master"
        "$venv/bin/gpumarket" agent enroll --master "$master" --token "$token" --data-dir "$state_dir" --gpus "$gpus" >/dev/null ||
            die "enrollment failed (the reason is above); a token works once and expires: create a new one in the console and run this again"
    else
        say "keeping the enrollment in $state_dir"
    fi
    [ -z "$agent_user" ] || chown -R "$agent_user" "$state_dir"
}

write_files() {
    {
        echo "# Written by install-agent.sh; re-running it rewrites this file. See gpumarket agent --help."
        echo "[agent]"
        echo "data_dir = $(toml_quote "$state_dir")"
        echo "gpus = $(toml_quote "$gpus")"
        [ -z "$zone" ] || echo "zone = $(toml_quote "$zone")"
        [ -z "$region" ] || echo "region = $(toml_quote "$region")"
    } >"$config_file.new"
    chmod 644 "$config_file.new"
    mv "$config_file.new" "$config_file"

    {
        echo "#!/bin/sh"
        echo "# Written by install-agent.sh: runs the installed gpumarket agent with its config."
        echo "exec $(shell_quote "$venv/bin/gpumarket") agent run --config $(shell_quote "$config_file") \"\$@\""
    } >"$wrapper.new"
    chmod 755 "$wrapper.new"
    mv "$wrapper.new" "$wrapper"

    if [ "$upgrade" = yes ] && [ "$(recorded user_created)" = yes ]; then
        created_user_record=yes
    else
        created_user_record=$created_user
    fi
    {
        echo "# Written by install-agent.sh: what it installed, for re-runs and --uninstall."
        echo "master=$master"
        echo "gpus=$gpus"
        echo "zone=$zone"
        echo "region=$region"
        echo "agent_user=$agent_user"
        echo "user_created=$created_user_record"
        echo "systemd=$systemd"
        echo "state_dir=$state_dir"
    } >"$record_file.new"
    mv "$record_file.new" "$record_file"
}

start_service() {
    [ -f "$UNIT_FILE" ] || installed_unit=yes
    render_unit "$agent_user" >"$UNIT_FILE.new"
    chmod 644 "$UNIT_FILE.new"
    mv "$UNIT_FILE.new" "$UNIT_FILE"
    systemctl daemon-reload
    systemctl enable --quiet "$UNIT_NAME"
    systemctl restart "$UNIT_NAME"
    say "started $UNIT_NAME (logs: journalctl -u $UNIT_NAME)"
}

install() {
    settle_install
    check_host
    # The service's user must be able to read the package root installs (the state dir is 0700).
    umask 022

    # Everything that can fail without changing the host comes first; from here on a failed
    # first install is undone by cleanup.
    created_prefix=no created_user=no created_state=no installed_unit=no changing=no finished=no
    work=$(mktemp -d "${TMPDIR:-/tmp}/gpumarket-install.XXXXXX")
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    [ -z "$region" ] || check_region
    [ "$enrolled" = yes ] || check_token
    get_package

    changing=yes
    if [ "$upgrade" = yes ]; then
        say "upgrading the agent in $prefix (the host keeps its identity)"
    else
        say "installing the agent in $prefix"
    fi
    [ -d "$prefix" ] || created_prefix=yes
    mkdir -p "$prefix/bin" "$prefix/etc"
    [ -z "$agent_user" ] || create_user
    install_package
    enroll
    write_files
    [ "$systemd" = no ] || start_service

    host_id=$("$venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["host_id"])' "$state_dir/identity.json")
    finished=yes
    if [ "$systemd" = no ] && [ "$upgrade" = yes ]; then
        say "restart the agent to run the new version: $wrapper"
    elif [ "$systemd" = no ]; then
        say "installed without a service; run the agent with: $wrapper"
    fi
    echo "host id: $host_id"
}

main() {
    parse_options "$@"
    # The whole script has been read: nothing run from here on may read the rest of a
    # `curl … | sh` pipe (or wait for a terminal).
    exec </dev/null
    case $action in
        print-unit) render_unit "${agent_user:-$DEFAULT_USER}" ;;
        uninstall) uninstall ;;
        install) install ;;
    esac
}

main "$@"
