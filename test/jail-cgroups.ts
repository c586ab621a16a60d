// What the KVM tests read of a jailed VM's cgroup, on a cgroup v2 host and on a v1 (hybrid) one
// alike: through src/jail/cgroup.ts, which knows where the jail put it.
import { readFileSync } from 'node:fs';
import { JailCgroup, type CgroupLimitsRead } from '../src/jail/cgroup';

/** The jailed node process of VM `id` (its cgroup also holds bwrap, which is root's); throws unless there is exactly one. */
export function jailedVmmPid(id: string): number {
  const pids = JailCgroup.find(id)?.pids() ?? [];
  const node = pids.filter((p) => /^Uid:\s+65534\b/m.test(readFileSync(`/proc/${p}/status`, 'utf8')) && readFileSync(`/proc/${p}/comm`, 'utf8').trim() === 'node');
  if (node.length !== 1) throw new Error(`jail ${id}: expected one jailed node process, found ${node.length} among ${pids.join(' ') || 'none'}`);
  return node[0];
}

/** Whether VM `id`'s jail cgroup still exists (any of its directories). */
export function jailCgroupExists(id: string): boolean {
  return JailCgroup.find(id) !== undefined;
}

/** The limits VM `id`'s jail cgroup holds; throws if it does not exist. */
export function jailCgroupLimits(id: string): CgroupLimitsRead {
  const cg = JailCgroup.find(id);
  if (!cg) throw new Error(`jail ${id}: no cgroup`);
  return cg.limits();
}
