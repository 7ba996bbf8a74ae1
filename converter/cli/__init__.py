"""The ``k3convert`` command: one module per command (as huggingface_hub's CLI), over the run, hub and
verify packages; ``group`` holds what every command shares."""
from .convert import FP4_ALIAS, finalize, mxfp4_to_int4
from .demo import demo, make_fixture_cmd
from .group import main
from .inspect import inspect_cmd
from .upload import upload_cmd
from .verify import verify_cmd

for _command in (mxfp4_to_int4, finalize, make_fixture_cmd, demo, verify_cmd, inspect_cmd, upload_cmd):
    main.add_command(_command)
main.add_alias(FP4_ALIAS, mxfp4_to_int4)

__all__ = ["main", "mxfp4_to_int4"]
