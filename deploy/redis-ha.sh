#!/bin/sh
# Start one member of shoal's Redis Sentinel set: a primary, 2 replicas and 3 sentinels
# (compose.ha.yaml; deploy/k8s/components/redis-sentinel; docs/deploy.md, "Redis high
# availability (Sentinel)").
#
#   redis-ha.sh server         a data node (the primary or a replica); runs redis-server
#   redis-ha.sh sentinel       a sentinel: writes its config unless it exists, then runs it
#   redis-ha.sh sentinel-conf  only writes the sentinel's config (a Kubernetes init container)
#
# Both keep a config file that Redis rewrites (CONFIG REWRITE after every fail-over, a
# sentinel's state after every change) in SHOAL_STATE_DIR, so a restarted member comes back
# in the role the set gave it. A member that has no such file yet asks where the primary is:
# the sentinels first, then the data nodes (a replica names its primary), and only when
# nobody answers does it take the first of SHOAL_REDIS_NODES (the initial primary).
#
# Environment: REDIS_PASSWORD (the data nodes' and the sentinels' password; never printed),
# SHOAL_ANNOUNCE_HOST (this member's stable DNS name, announced to the others),
# SHOAL_REDIS_NODES and SHOAL_SENTINELS ("host:port host:port ..."; the first node is the
# initial primary). Optional: SHOAL_REDIS_SERVICE (shoal), SHOAL_PORT (6379 / 26379),
# SHOAL_STATE_DIR (/data), SHOAL_REDIS_CONF (settings a data node includes:
# /usr/local/etc/redis/redis.conf), SHOAL_SENTINEL_QUORUM (2),
# SHOAL_SENTINEL_DOWN_AFTER_MS (1000), SHOAL_SENTINEL_FAILOVER_TIMEOUT_MS (3000),
# SHOAL_BIND (listen addresses; the server's default otherwise), REDIS_SERVER / REDIS_CLI
# (the binaries: redis-server, redis-cli).
set -eu
mode=${1:?usage: redis-ha.sh server|sentinel|sentinel-conf}
: "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
: "${SHOAL_ANNOUNCE_HOST:?set SHOAL_ANNOUNCE_HOST to this member's stable DNS name}"
: "${SHOAL_REDIS_NODES:?set SHOAL_REDIS_NODES (host:port of each data node; the initial primary first)}"
: "${SHOAL_SENTINELS:?set SHOAL_SENTINELS (host:port of each sentinel)}"
service=${SHOAL_REDIS_SERVICE:-shoal}
state=${SHOAL_STATE_DIR:-/data}
server=${REDIS_SERVER:-redis-server}
cli=${REDIS_CLI:-redis-cli}
nodes=$(echo "$SHOAL_REDIS_NODES" | tr ',' ' ')
sentinels=$(echo "$SHOAL_SENTINELS" | tr ',' ' ')
initial=${nodes%% *}
export REDISCLI_AUTH="$REDIS_PASSWORD"   # redis-cli reads it: no password in any argv
umask 077                                # the config files come to hold the password

log() { echo "redis-ha: $*" >&2; }

ask() {  # ask HOST:PORT COMMAND...: the raw reply, without CRs; empty when there is none in 3 s
    hp=$1
    shift
    if command -v timeout >/dev/null 2>&1; then
        timeout 3 "$cli" --raw -h "${hp%:*}" -p "${hp##*:}" "$@" 2>/dev/null | tr -d '\r' || true
    else
        "$cli" --raw -h "${hp%:*}" -p "${hp##*:}" "$@" 2>/dev/null | tr -d '\r' || true
    fi
}

field() {  # field NAME INFO_TEXT: the value of NAME:value in an INFO reply
    printf '%s\n' "$2" | sed -n "s/^$1://p" | head -n 1
}

is_port() {
    case "$1" in '' | *[!0-9]*) return 1 ;; esac
}

primary_from_sentinels() {  # host:port of the primary as the first sentinel that answers names it
    for s in $sentinels; do
        [ "$s" = "$me" ] && continue
        # shellcheck disable=SC2046 # two words: host and port
        set -- $(ask "$s" sentinel get-master-addr-by-name "$service")
        if [ "$#" -eq 2 ] && is_port "$2"; then
            echo "$1:$2"
            return
        fi
    done
}

primary_from_nodes() {  # the data nodes' own view: a primary with replicas, else a replica's primary
    with_replicas='' named='' alone=''
    for n in $nodes; do
        [ "$n" = "$me" ] && continue
        info=$(ask "$n" info replication)
        case "$(field role "$info")" in
            master)
                replicas=$(field connected_slaves "$info")
                if is_port "$replicas" && [ "$replicas" -gt 0 ]; then
                    with_replicas=${with_replicas:-$n}
                else
                    alone=${alone:-$n}
                fi
                ;;
            slave)
                host=$(field master_host "$info")
                port=$(field master_port "$info")
                if [ -n "$host" ] && is_port "$port"; then
                    named=${named:-$host:$port}
                fi
                ;;
        esac
    done
    echo "${with_replicas:-${named:-$alone}}"
}

follower_with_data() {  # a data node that replicates from $me and holds keys (named on stdout)
    for n in $nodes; do
        [ "$n" = "$me" ] && continue
        info=$(ask "$n" info replication)
        if [ "$(field role "$info")" = slave ] &&
            [ "$(field master_host "$info"):$(field master_port "$info")" = "$me" ] &&
            ask "$n" info keyspace | grep -q '^db[0-9]*:keys='; then
            echo "$n"
            return
        fi
    done
}

wait_resolvable() {  # a sentinel refuses to start on a name that does not resolve (yet)
    command -v getent >/dev/null 2>&1 || return 0
    tries=0
    until getent hosts "$1" >/dev/null 2>&1; do
        tries=$((tries + 1))
        if [ "$tries" -ge 60 ]; then
            log "$1 does not resolve after 60 s"
            exit 1
        fi
        sleep 1
    done
}

case "$mode" in
    server)
        port=${SHOAL_PORT:-6379}
        me="$SHOAL_ANNOUNCE_HOST:$port"
        conf="$state/redis-ha.conf"
        if [ ! -s "$conf" ]; then
            from=sentinels
            primary=$(primary_from_sentinels)
            if [ -z "$primary" ]; then
                from="the data nodes"
                primary=$(primary_from_nodes)
                if [ "$primary" = "$me" ]; then
                    # a replica follows this node (which has no state): on a first start one
                    # that came up sooner and holds nothing yet; but one that holds data means
                    # this node lost its own, and as an empty primary it would make the
                    # replica drop its copy. Then wait until the sentinels promote another.
                    follower=$(follower_with_data)
                    if [ -n "$follower" ]; then
                        log "$follower replicates from $me and holds data, but $me has no state in $state: not starting as an empty primary"
                        exit 1
                    fi
                fi
            fi
            if [ -z "$primary" ]; then
                from="nobody answered: the initial primary"
                primary=$initial
            fi
            base=${SHOAL_REDIS_CONF:-/usr/local/etc/redis/redis.conf}
            {
                echo "# written by deploy/redis-ha.sh; Redis rewrites it (CONFIG REWRITE) on every change of role"
                if [ -f "$base" ]; then
                    echo "include $base"
                fi
                echo "dir $state"
                if [ "$primary" != "$me" ]; then
                    echo "replicaof ${primary%:*} ${primary##*:}"
                fi
            } >"$conf.tmp"
            mv "$conf.tmp" "$conf"
            if [ "$primary" = "$me" ]; then
                log "starting as the primary ($from)"
            else
                log "starting as a replica of $primary ($from)"
            fi
        else
            log "starting in the role kept in $conf"
        fi
        # the password and this node's name from the environment on every start (CONFIG REWRITE
        # copies them into the file: drop those copies, so a rotated password replaces them)
        sed -e '/^requirepass /d' -e '/^masterauth /d' -e '/^primaryauth /d' -e '/^user default /d' \
            "$conf" >"$conf.tmp"
        mv "$conf.tmp" "$conf"
        # repl-diskless-sync-delay 0: a replica that needs a full copy (a new one, or one that
        # cannot go on partially after a fail-over) gets it at once, not 5 s later; shoal's
        # data is small, and until a replica is in sync no durable write is confirmed
        set -- "$conf" --port "$port" --appendonly yes --repl-diskless-sync-delay 0 \
            --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" \
            --replica-announce-ip "$SHOAL_ANNOUNCE_HOST" --replica-announce-port "$port"
        if [ -n "${SHOAL_BIND:-}" ]; then
            set -- "$@" --bind "$SHOAL_BIND"
        fi
        exec $server "$@"
        ;;
    sentinel | sentinel-conf)
        port=${SHOAL_PORT:-26379}
        me="$SHOAL_ANNOUNCE_HOST:$port"
        conf="$state/sentinel.conf"
        if [ ! -s "$conf" ]; then
            from=sentinels
            primary=$(primary_from_sentinels)
            if [ -z "$primary" ]; then
                from="the data nodes"
                primary=$(primary_from_nodes)
            fi
            if [ -z "$primary" ]; then
                from="nobody answered: the initial primary"
                primary=$initial
            fi
            wait_resolvable "${primary%:*}"
            {
                echo "# written by deploy/redis-ha.sh; the sentinel rewrites it with what it learns"
                echo "port $port"
                if [ -n "${SHOAL_BIND:-}" ]; then
                    echo "bind $SHOAL_BIND"
                fi
                echo "dir $state"
                echo "sentinel resolve-hostnames yes"
                echo "sentinel announce-hostnames yes"
                echo "sentinel announce-ip $SHOAL_ANNOUNCE_HOST"
                echo "sentinel announce-port $port"
                echo "sentinel monitor $service ${primary%:*} ${primary##*:} ${SHOAL_SENTINEL_QUORUM:-2}"
                echo "sentinel down-after-milliseconds $service ${SHOAL_SENTINEL_DOWN_AFTER_MS:-1000}"
                echo "sentinel failover-timeout $service ${SHOAL_SENTINEL_FAILOVER_TIMEOUT_MS:-3000}"
                echo "sentinel parallel-syncs $service 1"
            } >"$conf.tmp"
            mv "$conf.tmp" "$conf"
            log "monitoring $service at $primary ($from)"
        else
            log "starting with the state kept in $conf"
        fi
        # the password from the environment on every start (a rotated one replaces the old):
        # requirepass guards this sentinel and is what it sends to the other sentinels;
        # auth-pass is what it sends to the data nodes
        sed -e '/^requirepass /d' -e '/^user default /d' -e "/^sentinel auth-pass $service /d" "$conf" >"$conf.tmp"
        {
            echo "sentinel auth-pass $service $REDIS_PASSWORD"
            echo "requirepass $REDIS_PASSWORD"
        } >>"$conf.tmp"
        mv "$conf.tmp" "$conf"
        if [ "$mode" = sentinel ]; then
            exec $server "$conf" --sentinel
        fi
        ;;
    *)
        echo "usage: redis-ha.sh server|sentinel|sentinel-conf" >&2
        exit 2
        ;;
esac
