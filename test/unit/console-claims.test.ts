// Issue 10, item 13: a guest can print anything, "Kernel panic" included, so a crash's message
// says the reason is the guest's claim and quotes only the start of one line, made printable.
import { linuxShutdownCrash, MAX_QUOTE_CHARS, quoteConsole } from '../../src/backends/kvm/console-claims';

describe("a Linux guest's shutdown, as its console tells it", () => {
  it('a forged panic line is quoted as the guest\'s claim, printable and cut short', () => {
    const forged = `Kernel panic - not syncing: \x1b[2J\x07all VMs compromised ${'A'.repeat(100_000)}\r\n`;
    const crash = linuxShutdownCrash(['booting', forged, 'pvisor-agent: fatal: later']);
    expect(crash.reason).toBe('kernel-panic');
    expect(crash.message.startsWith('the guest kernel shut down; its console says it panicked: "Kernel panic - not syncing: ?[2J?all VMs')).toBe(true);
    // eslint-disable-next-line no-control-regex
    expect(crash.message).not.toMatch(/[\x00-\x1f\x7f]/);
    expect(crash.message.length).toBeLessThan(MAX_QUOTE_CHARS + 100);
    expect(crash.message.endsWith('..."')).toBe(true);
  });

  it("the agent's last fatal line when nothing claims a panic, and a plain shutdown otherwise", () => {
    expect(linuxShutdownCrash(['pvisor-agent: fatal: first', 'pvisor-agent: fatal: cannot mount /dev/vda'])).toEqual({
      kind: 'crash',
      reason: 'agent-fatal',
      message: 'the guest shut down; its console says the agent ended it: "pvisor-agent: fatal: cannot mount /dev/vda"',
    });
    expect(linuxShutdownCrash(['reboot: Restarting system'])).toEqual({ kind: 'crash', reason: 'shutdown', message: 'the guest kernel shut down (reboot or power-off)' });
  });

  it('quotes a line as JSON: quotes and backslashes cannot end the quote early', () => {
    expect(quoteConsole('  say "hi" \\ bye  ')).toBe('"say \\"hi\\" \\\\ bye"');
    expect(JSON.parse(quoteConsole('x'.repeat(MAX_QUOTE_CHARS + 1)))).toBe(`${'x'.repeat(MAX_QUOTE_CHARS)}...`);
  });
});
