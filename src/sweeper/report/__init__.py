"""What a run and a sweep leave behind: tables, summary.json, plots, report.md/.html."""
