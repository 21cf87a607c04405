"""The Pool overview's "Membership and leadership" row: the registry (etcd) as the controller follows it, and which
controller replica leads.

Pools with `discovery: registry` take their nodes from the registrations in etcd (docs/architecture.md, "Discovery");
with `registry.url` set, the replicas elect one leader ("Leader election"). Every replica runs its own discovery and
exports its own registry series, so pool-level values take the max over the replicas; the election series are per
replica (`id`). Without a registry the row shows no data: absent, not zero.
"""

from __future__ import annotations

from grayguard.dashboards.config import DashboardConfig
from grayguard.dashboards.panels import Q, single, timeline, ts
from grayguard.dashboards.promql import matchers, zero_fill

TITLE = "Membership and leadership"

P = matchers(pool="~$pool")  # membership series carry the pool

# grayguard_controller_leader per replica: (value, text, color) for the timeline
LEADER_CODES = (("0", "standby", "blue"), ("1", "leads", "green"))

NO_ELECTION = "No data: no registry.url (the controller runs alone, nobody is elected)."
NO_DISCOVERY = "No data: no pool with discovery: registry (or no registry.url)."


def events(name: str, m: str, by: str) -> str:
    """How many times a counter counted over the interval, summed by `by`: its value now less its value an interval
    ago, or less 0 for a series born since. A labelled counter's series is born at 1 with its first event, which
    increase() and rate() cannot see (a first removal would show as nothing); a reset (a controller restart) counts
    0, not a negative number."""
    c = f"{name}{{{m}}}"
    return f"sum by ({by}) (clamp_min({c} - ({c} offset $__rate_interval or {c} * 0), 0))"


def pool_max(name: str) -> str:
    """A membership gauge of the pool, one value whatever the number of replicas (each exports its own)."""
    return f"max by (pool) ({name}{{{P}}})"


def panels(cfg: DashboardConfig) -> list:
    """The row's panels, in layout order (six stats; 12 + 12 twice; a 24-wide timeline; 8 + 8 + 8)."""
    J = matchers(job=cfg.controller_job)  # noqa: N806 - the controller's pool-less series, as pool.py names it
    electing = f"sum(grayguard_controller_leader{{{J}}})"  # a replica takes part in an election: errors may be 0
    following = f"max(grayguard_membership_nodes{{{P}}})"  # the pool follows the registry: no change is a 0
    changes = events("grayguard_membership_changes_total", P, "action")
    return [
        single("Leaders", "Replicas that lead now (grayguard_controller_leader summed): 1 with one leader for every "
               "pool, one per shard with registry.shard_pools. NOBODY for longer than registry.lease_ttl_s + a tick "
               "pages GrayguardNoLeader: nobody writes HAProxy. " + NO_ELECTION,
               [Q(f"sum(grayguard_controller_leader{{{J}}})", "leaders")], base="red", steps=[(1, "green")],
               mapping=[("0", "NOBODY", "red")]),
        single("Registry", "The controllers' discovery reaches etcd (grayguard_registry_up, the lowest replica): "
               "FROZEN means membership follows the last snapshot and nothing is removed; "
               "GrayguardControllerRegistryDown pages after a minute. " + NO_DISCOVERY,
               [Q(f"min(grayguard_registry_up{{{J}}})", "registry")], base="red", steps=[(1, "green")],
               mapping=[("0", "FROZEN", "red"), ("1", "up", "green")]),
        single("Snapshot age", "Seconds since the membership snapshot was last known current, the oldest replica's "
               "(grayguard_registry_snapshot_age_seconds): about 0 while etcd answers, growing while it does not.",
               [Q(f"max(grayguard_registry_snapshot_age_seconds{{{J}}})", "age")], "s", steps=[(5, "orange")]),
        single("Registered nodes", "Serving registrations of the pool in etcd (grayguard_membership_nodes): the "
               "nodes membership keeps in the backend.", [Q(f"sum({pool_max('grayguard_membership_nodes')})", "nodes")],
               base="blue"),
        single("Joining / removing", "Servers added and not yet UP in HAProxy (joining), and servers out of rotation "
               "because their registration ended, deleted once their connections are gone (removing).",
               [Q(f"sum({pool_max('grayguard_membership_joining')})", "joining"),
                Q(f"sum({pool_max('grayguard_membership_removing')})", "removing")], base="blue"),
        single("Expiries held", "Expired registrations kept in rotation because more expired within a minute than "
               "registry.expiry_cap_per_minute allows (a partition looks like mass death): "
               "GrayguardRegistryMassExpiry pages.",
               [Q(f"sum({pool_max('grayguard_membership_expiries_held')})", "held")], steps=[(1, "red")]),
        ts("Nodes: registered vs in HAProxy",
           "Serving registrations in etcd (grayguard_membership_nodes) against the servers of the pool's backend "
           "(grayguard_pool_nodes), and the servers on their way in (joining: added, not yet UP) and out (removing: "
           "drained after a leave or an expiry, deleted once their connections are gone). In HAProxy above "
           "registered: servers being removed, or static servers of the backend the registry does not name.",
           [Q(pool_max("grayguard_membership_nodes"), "{{pool}} registered"),
            Q(pool_max("grayguard_pool_nodes"), "{{pool}} in HAProxy"),
            Q(pool_max("grayguard_membership_joining"), "{{pool}} joining"),
            Q(pool_max("grayguard_membership_removing"), "{{pool}} removing")],
           "short", lo=0, step_line=True, dashed=" (joining|removing)$"),
        ts("Joins and removals",
           "Membership writes per interval, by action (grayguard_membership_changes_total): add = a registration "
           "joined (added at the warm-up weight, then slow start), drain = it left or its lease expired (out of "
           "rotation at once), delete = removed once its connections were gone, ready = registered again while "
           "being removed, addr = moved to a new address.",
           [Q(zero_fill(changes, following, "action"), "{{action}}")], "short", lo=0, bars=True, stacked=True),
        ts("Expiries held back by the cap",
           "Expired registrations kept in rotation (grayguard_membership_expiries_held) against how many expiries "
           "may remove per minute now (grayguard_membership_expiry_cap, dashed): more leases ending at once than "
           "the cap is a registry or network problem, not that many dead nodes. Graceful leaves are never capped.",
           [Q(pool_max("grayguard_membership_expiries_held"), "{{pool}} held"),
            Q(pool_max("grayguard_membership_expiry_cap"), "{{pool}} cap per minute")],
           "short", lo=0, step_line=True, dashed=" cap per minute$"),
        ts("Registry watch per replica",
           "Each replica's view of etcd: snapshot age (grayguard_registry_snapshot_age_seconds, about 0 while etcd "
           "answers), and per interval the failed discovery calls by kind (grayguard_discovery_errors_total) and the "
           "full listings by why (grayguard_discovery_relists_total: start, reconnect, compacted): a steady "
           "reconnect count is a flapping etcd connection.",
           [Q(f"grayguard_registry_snapshot_age_seconds{{{J}}}", "{{instance}} snapshot age"),
            Q(zero_fill(events("grayguard_discovery_errors_total", J, "instance, kind"),
                        f"max by (instance) (grayguard_registry_up{{{J}}})", "kind", on="instance"),
              "{{instance}} errors {{kind}}"),
            Q(events("grayguard_discovery_relists_total", J, "instance, reason"), "{{instance}} relists {{reason}}")],
           "short", lo=0, dashed=" (errors|relists) "),
        timeline("Which replica leads",
                 "Each controller replica by id (--id, default hostname:pid): leads (holds the leader key with a "
                 "confirmed lease) or standby (stands by, or fenced itself: it could not renew its lease and writes "
                 "nothing). A crashed leader's standby leads within registry.lease_ttl_s + a tick. " + NO_ELECTION,
                 [Q(f"max by (id) (grayguard_controller_leader{{{J}}})", "{{id}}")], LEADER_CODES, h=5),
        ts("Pools led per replica", "Pools each replica leads (grayguard_controller_led_pools): all of them on the "
           "leader, its share of them with registry.shard_pools.",
           [Q(f"max by (id) (grayguard_controller_led_pools{{{J}}})", "{{id}}")], "short", w=8, lo=0,
           step_line=True),
        ts("Leader changes", "Times a replica took or lost the leadership of a scope, per interval "
           "(grayguard_controller_leader_changes_total; a hand-over counts on both sides). A steady rise: replicas "
           "keep losing their leases (etcd too slow for registry.lease_ttl_s, or ticks too long).",
           [Q(events("grayguard_controller_leader_changes_total", J, "instance"), "{{instance}}")], "short", w=8,
           lo=0, bars=True),
        ts("Election errors", "Failed etcd calls of the election per interval, by operation and kind "
           "(grayguard_controller_registry_errors_total): publish failures hold a pool's HAProxy writes for the "
           "tick, lease failures end in fencing. 0 while the replicas reach etcd.",
           [Q(zero_fill(events("grayguard_controller_registry_errors_total", J, "op, kind"), electing, "kind"),
              "{{op}} {{kind}}")], "short", w=8, lo=0, bars=True),
    ]
