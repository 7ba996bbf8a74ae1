"""The ``k3convert`` command group: one error line for usage errors, -q on every command, close
spellings for an unknown command, and a quick exit."""
from __future__ import annotations

import sys

import click

from .. import __version__
from ..terminal.failure import params_in, report, stream_for
from ..terminal.progress import QUIET_ENV, libraries_quiet, set_quiet
from .suggest import unknown_command


class _Main(click.Group):
    """The command group, with click's usage errors (a bad option value from the command line, a job
    file or the environment) as our one line, ``k3convert: error: ...``, exit 2 (JSON where the command
    prints JSON: ``failure``); -q/--quiet on every command (``add_command``); an unknown command
    names the close ones. From the command line the process leaves at once when done
    (fastexit: no seconds of torch teardown, no process left behind)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aliases: dict[str, str] = {}   # another name people type -> the command's own (add_alias)

    def add_alias(self, alias: str, cmd: click.Command) -> None:
        """``alias`` runs ``cmd`` (the same command object: its code, options and help, never a copy);
        ``--help`` lists it under Aliases."""
        assert cmd.name is not None and self.commands.get(cmd.name) is cmd, "register the command first"
        self.aliases[alias] = cmd.name

    def get_command(self, ctx, cmd_name):
        return super().get_command(ctx, self.aliases.get(cmd_name, cmd_name))

    def format_commands(self, ctx, formatter):
        super().format_commands(ctx, formatter)
        if self.aliases:
            with formatter.section("Aliases"):
                formatter.write_dl([(a, f"the same command as {n}") for a, n in sorted(self.aliases.items())])

    def add_command(self, cmd, name=None):
        cmd.params.append(click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_quiet,
                                       help=QUIET_HELP))  # `k3convert demo -q` as `k3convert -q demo`
        super().add_command(cmd, name)

    def resolve_command(self, ctx, args):
        name = click.utils.make_str(args[0]) if args else None
        self.k3_command = name and self.aliases.get(name, name)  # streams.Guard: whether it is a job
        if name is not None and self.get_command(ctx, name) is None and not name.startswith("-"):
            raise click.UsageError(unknown_command(name, [*self.list_commands(ctx), *self.aliases]), ctx)
        _, cmd, rest = super().resolve_command(ctx, args)
        return name, cmd, rest   # usage lines and errors say the name typed

    def __call__(self, *args, **kwargs):
        """``main()`` with the process's own arguments is the command line (the ``k3convert`` script,
        ``python -m converter``): it leaves at once. Given arguments (click's test runner, a
        script driving the CLI), it exits as click does."""
        try:
            return self.main(*args, **kwargs)
        except SystemExit as e:
            if (args[0] if args else kwargs.get("args")) is not None:
                raise
            from ..terminal.fastexit import leave
            leave(e.code)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        from ..terminal.fastexit import exit_status
        from ..terminal.streams import Guard
        self.k3_command = None
        code: int | str | None = 0
        with Guard() as out:  # output that cannot be written (a closed pipe, a full disk): one line (T10)
            try:
                self._standalone(args, prog_name, complete_var, **extra)
            except SystemExit as e:
                code = e.code
        sys.exit(out.status(exit_status(code), self.k3_command))

    def _standalone(self, args, prog_name, complete_var, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as e:  # usage errors: 2; as JSON where the command prints JSON
            typed = params_in(sys.argv[1:] if args is None else args)
            how = stream_for({**typed, **(ctx.params if (ctx := getattr(e, "ctx", None)) else {})})
            report(" ".join(e.format_message().split()), e.exit_code, how)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


QUIET_HELP = (f"No progress bars or status lines on stderr ({QUIET_ENV}=1 too); results, errors and --progress "
              "json stay. TQDM_DISABLE=1 or HF_HUB_DISABLE_PROGRESS_BARS=1 turn the bars off.")


def _quiet(ctx: click.Context, param, on: bool) -> None:
    """-q/--quiet, before or after the command's name: for the whole command (``progress.quiet``), the
    Hub's bars included; the group's context ends it."""
    if on:
        root = ctx.find_root()
        set_quiet(True)
        root.call_on_close(lambda: set_quiet(False))
        root.with_resource(libraries_quiet())


@click.group(cls=_Main, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3convert")
@click.option("-q", "--quiet", is_flag=True, envvar=QUIET_ENV, expose_value=False, callback=_quiet,
              help=QUIET_HELP + " Every command takes it.")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Convert Kimi K3's MXFP4 routed experts to int4 group 32, once, offline."""
    if ctx.invoked_subcommand is None:  # bare `k3convert`: the help, as `hf` and `vllm` print it
        click.echo(ctx.get_help())
