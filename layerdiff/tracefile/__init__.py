"""The layerdiff trace file: one HDF5 file per run, streamed and crash-safe.

Layout (readable with plain h5py, see docs/trace-format.md):

    /            attrs: format="layerdiff-trace", format_version, meta (JSON: run metadata)
    /index       uint8, JSON lines: one line per record (module call, parameter, end marker)
    /data        uint8, the bytes of every tensor stored in "full" mode, C order, back to back

A tensor entry in a record names ``offset``/``nbytes`` into /data plus ``dtype`` and ``shape``, so
``np.frombuffer(f["data"][off:off + n], dtype).reshape(shape)`` reads it back (bfloat16 is stored as uint16).

Both datasets have their chunks reserved ahead of the data and the writer puts bytes straight into them, so a run
killed mid-way (even kill -9) leaves a file that opens normally and holds every record completed before the kill
(the index ends in zeros where the reserve was not used). Read a live or killed trace with
``h5py.File(path, "r", locking=False)``.

``writer`` writes a trace, ``reader`` reads one (``chunks``: its tensor bytes straight from the file), ``index`` is
the JSON lines of records, ``tensors`` the dtypes and statistics of the tensors stored.
"""
