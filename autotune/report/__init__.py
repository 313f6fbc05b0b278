"""The HTML report: :mod:`.model` computes every number, :mod:`.charts` the chart data and figures,
:mod:`.html` lays them out in one self-contained file (:func:`autotune.report.html.write_report`)."""
