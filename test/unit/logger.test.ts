// The logger option: what is accepted, what each line carries, and that a logger that throws
// never reaches the VM's code paths.
import { EventEmitter } from 'eventemitter3';
import { InvalidOptionError } from '../../src/errors';
import { parseLogger, VmLog, type LogFields, type Logger } from '../../src/logger';
import { Vm } from '../../src';

type Line = [level: string, message: string, fields: LogFields];
function collecting(): { logger: Logger; lines: Line[] } {
  const lines: Line[] = [];
  const at = (level: string) => (message: string, fields: LogFields) => void lines.push([level, message, fields]);
  return { logger: { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') }, lines };
}

describe('parseLogger', () => {
  it('takes undefined, console and any object with the four methods', () => {
    expect(parseLogger(undefined)).toBeUndefined();
    expect(parseLogger(console)).toBe(console);
    const { logger } = collecting();
    expect(parseLogger(logger)).toBe(logger);
  });
  it.each([
    [null, 'expected an object with debug, info, warn and error methods, got null'],
    ['console', 'expected an object with debug, info, warn and error methods, got string'],
    [{ info() {} }, 'has no debug, warn, error methods'],
    [{ debug() {}, info() {}, warn() {}, error: 1 }, 'has no error method'],
  ])('refuses %p naming what is missing', (value, why) => {
    expect(() => parseLogger(value)).toThrow(new InvalidOptionError('logger', why));
  });
  it('is checked by Vm.start before anything is created', async () => {
    await expect(Vm.start({ guest: 'probe', memory: '64MiB', logger: { info() {} } as never })).rejects.toThrow(/^logger: has no debug, warn, error methods$/);
  });
});

describe('VmLog', () => {
  it('writes nothing without a logger, and says so', () => {
    const log = new VmLog(undefined, 'a');
    expect(log.enabled).toBe(false);
    expect(() => log.write('info', 'x')).not.toThrow();
  });
  it('puts the VM name in every line', () => {
    const { logger, lines } = collecting();
    new VmLog(logger, 'vm-1').write('debug', 'files.read', { ms: 1.5 });
    expect(lines).toEqual([['debug', 'files.read', { vm: 'vm-1', ms: 1.5 }]]);
  });
  it('ignores a logger that throws', () => {
    const boom = () => {
      throw new Error('disk full');
    };
    const log = new VmLog({ debug: boom, info: boom, warn: boom, error: boom }, 'a');
    expect(() => log.write('error', 'x')).not.toThrow();
  });
  it("follows a VM's events at their levels", () => {
    const { logger, lines } = collecting();
    const vm = new EventEmitter();
    new VmLog(logger, 'v').followEvents(vm);
    vm.emit('state', 'suspended');
    vm.emit('warning', 'virtio-blk: bad descriptor');
    vm.emit('released', { ms: 12.5 });
    vm.emit('crash', new Error('triple fault'));
    vm.emit('exit', { state: 'crashed' });
    expect(lines.map(([level, message]) => `${level} ${message}`)).toEqual([
      'info state suspended',
      'warn virtio-blk: bad descriptor',
      'debug memory released',
      'error crashed: triple fault',
      'info exited (crashed)',
    ]);
    expect(lines[0]![2]).toEqual({ vm: 'v', state: 'suspended' });
  });
});
