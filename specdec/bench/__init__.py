"""``specdec bench`` and its relatives: what speculation costs and gains, measured against plain decoding.

Nothing here is on the runtime's path; the engine never imports it.
"""
