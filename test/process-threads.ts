import { readdirSync, readFileSync } from 'node:fs';

/**
 * Threads of this process that pvisor and Node own. KVM on newer kernels (6.13+, e.g. kvm_pvm
 * hosts) adds a kernel worker per VM to the VM's process (`kvm-nx-lpage-recovery`, a vhost_task),
 * which shows in /proc/self/task but is the kernel's, created and ended with the VM fd.
 */
export function processThreads(): number {
  return readdirSync('/proc/self/task').filter((t) => {
    try {
      return !readFileSync(`/proc/self/task/${t}/comm`, 'utf8').startsWith('kvm-');
    } catch {
      return false; // ended while listing
    }
  }).length;
}
