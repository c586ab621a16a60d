/**
 * A memory cgroup made for one bench cell, so that "group memory" (the kernel's charge, which
 * includes page cache) can be read as the study reads it: cgroup v1 `memory.usage_in_bytes` where
 * the v1 memory controller is mounted (these machines), v2 `memory.current` otherwise.
 */
import { existsSync, mkdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { processResident } from '../memory-usage';

const V1_ROOT = '/sys/fs/cgroup/memory';
const V2_ROOT = '/sys/fs/cgroup';

/** A cgroup for one cell; `undefined` from {@link CellCgroup.create} when none can be made. */
export class CellCgroup {
  private constructor(
    /** The cgroup's directory. */
    readonly path: string,
    private readonly usageFile: string,
  ) {}

  /**
   * Makes a fresh cgroup, or returns why it cannot (not root, no memory controller), so the bench
   * can say so instead of printing a figure it did not read.
   */
  static create(name: string): CellCgroup | string {
    let root: string;
    let usage: string;
    if (existsSync(join(V1_ROOT, 'memory.usage_in_bytes'))) {
      root = V1_ROOT;
      usage = 'memory.usage_in_bytes';
    } else if (existsSync(join(V2_ROOT, 'cgroup.controllers')) && readFileSync(join(V2_ROOT, 'cgroup.controllers'), 'utf8').includes('memory')) {
      root = V2_ROOT;
      usage = 'memory.current';
    } else {
      return 'no memory cgroup controller is mounted';
    }
    const path = join(root, name);
    try {
      // cgroup v2 gives a child memory.current only when its parent delegates the controller.
      if (root === V2_ROOT && !readFileSync(join(root, 'cgroup.subtree_control'), 'utf8').split(/\s+/).includes('memory')) writeFileSync(join(root, 'cgroup.subtree_control'), '+memory');
      mkdirSync(path);
    } catch (e) {
      return `cannot create ${path}: ${(e as Error).message}`;
    }
    return new CellCgroup(path, usage);
  }

  /**
   * A shell prefix that moves the process into this cgroup and then execs the real command, so
   * that everything the command allocates, from its first page, is charged here.
   */
  wrap(command: string, args: string[]): [string, string[]] {
    return ['/bin/sh', ['-c', 'echo $$ > "$0" && exec "$@"', join(this.path, 'cgroup.procs'), command, ...args]];
  }

  /** The group's charged memory, bytes (includes page cache and kernel overhead). */
  memoryBytes(): number {
    return Number(readFileSync(join(this.path, this.usageFile), 'utf8').trim());
  }

  /** Of {@link memoryBytes}, the page cache (v1 `cache`, v2 `file` in memory.stat). */
  pageCacheBytes(): number {
    const stat = readFileSync(join(this.path, 'memory.stat'), 'utf8');
    const m = /^(?:cache|file) (\d+)$/m.exec(stat);
    return m ? Number(m[1]) : 0;
  }

  /** PSS summed over every process in the group: the study's "resident". */
  pssBytes(): number {
    let sum = 0;
    for (const pid of this.pids()) {
      try {
        sum += processResident(pid).pssBytes;
      } catch {
        // The process ended between listing and reading: it costs nothing any more.
      }
    }
    return sum;
  }

  /** Processes in the group. */
  pids(): number[] {
    return readFileSync(join(this.path, 'cgroup.procs'), 'utf8').split('\n').filter(Boolean).map(Number);
  }

  /** Removes the (empty) cgroup. */
  remove(): void {
    try {
      rmdirSync(this.path);
    } catch {
      // Still busy (a process is exiting); the kernel frees it when the last one is gone, and the
      // name is unique per bench run, so nothing reuses it.
    }
  }
}
