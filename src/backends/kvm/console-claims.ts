/**
 * What a Linux guest's console says about why it shut down. KVM only reports a shutdown (with
 * reboot=t panic=-1, a reboot, a power-off and a panic all end in a triple fault); why is only
 * what the console says, and anything in the guest can print "Kernel panic". So a crash's message
 * says it is the guest's claim and quotes at most the start of one line, made printable.
 */
import type { VcpuAction } from './io-bus';

/** Longest quote of guest console text in an error, in characters. */
export const MAX_QUOTE_CHARS = 300;

/** Guest console text in an error: trimmed, control characters shown as `?`, at most {@link MAX_QUOTE_CHARS}. */
export function quoteConsole(line: string): string {
  // eslint-disable-next-line no-control-regex
  const clean = line.trim().replace(/[\x00-\x1f\x7f]/g, '?');
  return JSON.stringify(clean.length > MAX_QUOTE_CHARS ? `${clean.slice(0, MAX_QUOTE_CHARS)}...` : clean);
}

/** The crash a Linux guest's shutdown is, from its console's last lines. */
export function linuxShutdownCrash(recentConsole: readonly string[]): VcpuAction & { kind: 'crash' } {
  const panic = recentConsole.find((l) => l.includes('Kernel panic'));
  // The agent (PID 1) reboots on a fatal error (e.g. a rootfs it cannot mount) after saying why.
  const agentFatal = [...recentConsole].reverse().find((l) => l.includes('pvisor-agent: fatal'));
  if (panic) return { kind: 'crash', reason: 'kernel-panic', message: `the guest kernel shut down; its console says it panicked: ${quoteConsole(panic)}` };
  if (agentFatal) return { kind: 'crash', reason: 'agent-fatal', message: `the guest shut down; its console says the agent ended it: ${quoteConsole(agentFatal)}` };
  return { kind: 'crash', reason: 'shutdown', message: 'the guest kernel shut down (reboot or power-off)' };
}
