"""A run's state on disk: the names of the files k3convert writes in DST, atomic writes, the JSON
and zstd records, and the locks that let runs, job-array parts and uploads share one DST.

Every file is replaced atomically (write, fsync, rename), so a kill at any moment leaves either the
old or the new version. DST is complete exactly when the manifest says ``complete: true``, and that
is written last.
"""
