"""The compile report (text, JSON, HTML)."""
