"""House style for panels, on top of grafana-foundation-sdk's builders: one call per panel kind."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

# Every panel reads the dashboard's `datasource` variable, so one JSON works with any Prometheus.
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
DASHED = dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})


@dataclass(frozen=True)
class Link:
    """A link to a grayguard dashboard: its uid, and the variables it opens with (name -> value, which may be a
    data-link variable such as ${__field.labels.pool}). The time range is kept."""

    title: str
    uid: str
    params: tuple[tuple[str, str], ...] = ()
    raw: tuple[str, ...] = ()  # query segments as they are, e.g. ${pool:queryparam} (var-pool=a&var-pool=b)

    @property
    def url(self) -> str:
        """Grafana's path to the dashboard with var-<name>=<value> for each param and the current time range."""
        query = [f"var-{k}={v}" for k, v in self.params] + list(self.raw) + ["${__url_time_range}"]
        return f"/d/{self.uid}?" + "&".join(query)

    def builder(self) -> db.DashboardLink:
        """The link as the SDK builds panel links and data links."""
        return db.DashboardLink(self.title).type(dm.DashboardLinkType.LINK).url(self.url)


@dataclass(frozen=True)
class Q:
    """One query of a panel: PromQL, legend, and whether it is an instant query (tables, stats)."""

    expr: str
    legend: str = "__auto"
    instant: bool = False


def _targets(queries: Sequence[Q], fmt_table: bool = False) -> list[pb.Dataquery]:
    out = []
    for i, q in enumerate(queries):
        t = pb.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        t = t.instant() if q.instant else t.range()
        if fmt_table:
            t = t.format(pm.PromQueryFormat.TABLE)
        out.append(t)
    return out


def thresholds(base: str = "green", steps: Sequence[tuple[float, str]] = ()) -> db.ThresholdsConfig:
    """Absolute thresholds: `base` below the first step, then each (value, color)."""
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=None, color=base)] + [dm.Threshold(value=v, color=c) for v, c in steps])


def value_map(mapping: Sequence[tuple[str, str, str]]) -> list[dm.ValueMap]:
    """Value -> (text, color) mappings, e.g. [("0", "healthy", "green")]."""
    return [dm.ValueMap(options={v: dm.ValueMappingResult(text=t, color=c, index=i)
                                 for i, (v, t, c) in enumerate(mapping)})]


def _legend(table_right: bool) -> cb.VizLegendOptions:
    leg = cb.VizLegendOptions().show_legend(True)
    if table_right:
        return leg.display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.RIGHT).calcs(
            ["lastNotNull", "max"]).sort_by("Last *").sort_desc(True)
    return leg.display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM)


def ts(title: str, description: str, queries: Sequence[Q], unit: str = "short", *, w: int = 12, h: int = 8,
       lo: float | None = None, hi: float | None = None, steps: Sequence[tuple[float, str]] = (),
       dashed: str | None = None, stacked: bool = False, bars: bool = False, step_line: bool = False,
       legend_table: bool = False, links: Sequence[Link] = ()) -> timeseries.Panel:
    """A time series panel. steps: threshold lines drawn dashed; dashed: regex of series drawn dashed; links: data
    links on every series (their URLs may read the series' labels, ${__field.labels.<name>})."""
    p = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE)
         .targets(_targets(queries)).unit(unit).span(w).height(h).line_width(1).fill_opacity(10 if not bars else 80)
         .show_points(cm.VisibilityMode.NEVER).legend(_legend(legend_table))
         .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)))
    if lo is not None:
        p = p.min(lo)
    if hi is not None:
        p = p.max(hi)
    if steps:
        p = p.thresholds(thresholds("green", steps)).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED))
    if dashed:
        p = p.override_by_regexp(dashed, [DASHED, dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0)])
    if stacked:
        p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    if bars:
        p = p.draw_style(cm.GraphDrawStyle.BARS)
    if step_line:
        p = p.line_interpolation(cm.LineInterpolation.STEP_AFTER)
    if links:
        p = p.data_links([lk.builder() for lk in links])
    return p


def timeline(title: str, description: str, queries: Sequence[Q], mapping: Sequence[tuple[str, str, str]], *,
             w: int = 24, h: int = 8, links: Sequence[Link] = ()) -> statetimeline.Panel:
    """A state timeline: one row per series, values shown through `mapping` (value, text, color); links: data
    links on every row."""
    p = (statetimeline.Panel().title(title).description(description).datasource(DATASOURCE)
         .targets(_targets(queries)).span(w).height(h).mappings(value_map(mapping))
         .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS)).thresholds(thresholds("green"))
         .show_value(cm.VisibilityMode.AUTO).merge_values(True).row_height(0.9).fill_opacity(80)
         .legend(cb.VizLegendOptions().show_legend(False)))
    return p.data_links([lk.builder() for lk in links]) if links else p


def single(title: str, description: str, queries: Sequence[Q], unit: str = "short", *, w: int = 4, h: int = 4,
           steps: Sequence[tuple[float, str]] = (), base: str = "green",
           mapping: Sequence[tuple[str, str, str]] = ()) -> stat.Panel:
    """A stat panel showing the last value of each series."""
    p = (stat.Panel().title(title).description(description).datasource(DATASOURCE).targets(_targets(queries))
         .unit(unit).span(w).height(h).thresholds(thresholds(base, steps))
         .color_mode(cm.BigValueColorMode.BACKGROUND).graph_mode(cm.BigValueGraphMode.AREA)
         .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    if mapping:
        p = p.mappings(value_map(mapping))
    return p


def table_of(title: str, description: str, queries: Sequence[Q], *, w: int = 24, h: int = 6,
             hide: Sequence[str] = ("Time", "Value", "__name__", "job"), order: Sequence[str] = (),
             rename: Mapping[str, str] | None = None, cell_links: Mapping[str, Sequence[Link]] | None = None,
             panel_links: Sequence[Link] = ()) -> table.Panel:
    """A table of the labels of an instant query (one row per series), `hide` columns left out, `order` first.
    cell_links: column -> links on each of its cells (${__value.raw} is the cell, ${__data.fields.<col>} its row's
    other columns); panel_links: links in the panel's header."""
    organize = dm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {c: True for c in hide}, "indexByName": {c: i for i, c in enumerate(order)},
        "renameByName": dict(rename or {})})
    p = (table.Panel().title(title).description(description).datasource(DATASOURCE)
         .targets(_targets(queries, fmt_table=True)).span(w).height(h).with_transformation(organize))
    for col, links in (cell_links or {}).items():
        p = p.override_by_name(col, [dm.DynamicConfigValue(id_val="links", value=[
            {"title": lk.title, "url": lk.url} for lk in links])])
    if panel_links:
        p = p.links([lk.builder() for lk in panel_links])
    return p


def row(title: str) -> db.Row:
    """A row header (not collapsed: its panels follow it at the top level)."""
    return db.Row(title)


# ---- dashboard-level pieces ------------------------------------------------------------------------------

def datasource_variable() -> db.DatasourceVariable:
    """The `datasource` variable every query reads: any Prometheus data source (the default one first)."""
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, query: str, description: str, *, multi: bool = False) -> db.QueryVariable:
    """A `label_values(...)` variable, refreshed with the time range; multi adds All (= regex .*, so queries match
    it with =~, which takes one value, several (Grafana joins them as a|b) or All alike)."""
    v = (db.QueryVariable(name).label(label).description(description).datasource(DATASOURCE).query(query)
         .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.NATURAL_ASC))
    if multi:
        v = v.multi(True).include_all(True).all_value(".*").current(
            dm.VariableOption(selected=True, text="All", value="$__all"))
    return v


@dataclass(frozen=True)
class PromAnnotation:
    """A Prometheus annotation: every step where expr has a sample becomes an event (SDK lacks the fields)."""

    name: str
    expr: str
    color: str
    title: str  # titleFormat, with {{label}} templates
    tag_keys: str  # comma-separated labels shown as tags
    step: str = "30s"

    def to_json(self) -> dict:
        """Grafana's dashboard JSON for this annotation."""
        return {"name": self.name, "datasource": DATASOURCE.to_json(), "enable": True, "hide": False,
                "iconColor": self.color, "expr": self.expr, "step": self.step, "titleFormat": self.title,
                "tagKeys": self.tag_keys, "textFormat": "", "useValueForTime": False}


def dashboard(uid: str, title: str, description: str, cfg_refresh: str, time_from: str,
              siblings: Sequence[tuple[str, str]] = ()) -> db.Dashboard:
    """A grayguard dashboard shell: tags, links to its siblings, shared crosshair, time and refresh.

    siblings: (title, uid) of the dashboards linked by name at the top, with the variables both have (pool,
    instance) and the time range; the "grayguard" drop-down lists every dashboard tagged grayguard.
    """
    d = (db.Dashboard(title).uid(uid).description(description).tags(["grayguard"]).editable()
         .tooltip(dm.DashboardCursorSync.CROSSHAIR).time(time_from, "now").refresh(cfg_refresh)
         .timezone("browser"))
    for name, sibling in siblings:
        d = d.link(db.DashboardLink(name).type(dm.DashboardLinkType.LINK).url(f"/d/{sibling}").icon("dashboard")
                   .include_vars(True).keep_time(True))
    return d.link(db.DashboardLink("grayguard").type(dm.DashboardLinkType.DASHBOARDS).tags(["grayguard"])
                  .as_dropdown(True).include_vars(True).keep_time(True))


def finish(d: db.Dashboard, annotations: Sequence[PromAnnotation] = ()) -> dict:
    """The dashboard as Grafana JSON: annotations added, panel ids numbered 1.. in layout order."""
    doc = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    doc["annotations"] = {"list": [a.to_json() for a in annotations]}
    for i, p in enumerate(doc.get("panels", []), start=1):
        p["id"] = i
    return doc
