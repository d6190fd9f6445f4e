"""Development tools of the reference deployment: the demo, the embedded Redis broker, process helpers.

Not installed with the library; run as ``python -m devtools demo`` (what ``make demo`` does).
"""
