/**
 * V8 flags for pvisor's long-running Node processes: `pvisor` (a `pvisor run` holds a VM for its
 * whole life; `pvisor-daemon serve` becomes a native program once its options are checked). The
 * bin passes them in its `#!/usr/bin/env -S node ...` line (test/unit/cli-usage.test.ts keeps the
 * two in step), and pvisor's benches pass them to the processes they start, so a bench cell
 * measures what a user runs.
 *
 * `--max-semi-space-size=1` (MiB): V8's young generation otherwise grows to 16 MiB semispaces
 * in a process that allocates quickly, as a page pool's merge pass does on both ends, and keeps
 * them (docs/design-figures.md, "Node flags", has what it saves the daemon and its VMs).
 *
 * `--expose-gc`: when every VM of the process is idle (and once after a VM starts), pvisor gives
 * the process's own idle pages back (src/sys/process-pages.ts); a full collection first lets V8
 * return its free pages too, which it can only do when `gc` is exposed. docs/memory-layer.md
 * ("The VMM process") has the figures.
 *
 * A library user's process chooses its own flags: see the README ("Using the SDK").
 */
export const PVISOR_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=1', '--expose-gc'];

/**
 * Environment for the same processes, set by the `pvisor` bin's `#!` line (through `env -S`) and by
 * the benches for the processes they start.
 *
 * `MALLOC_ARENA_MAX=1`: glibc gives each thread that allocates an arena of its own (up to eight
 * per core), and each arena keeps what its thread freed. A VM process's V8 helper threads
 * (collection, compilation) grew arenas of a few MiB each during a page pool's merge passes
 * (docs/design-figures.md, "Node flags").
 */
export const PVISOR_NODE_ENV: Readonly<Record<string, string>> = { MALLOC_ARENA_MAX: '1' };

/** This process's environment with {@link PVISOR_NODE_ENV}: for a pvisor process it starts. */
export function pvisorNodeEnv(): NodeJS.ProcessEnv {
  return { ...process.env, ...PVISOR_NODE_ENV };
}
