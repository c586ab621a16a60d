// Network setup on a host that cannot do it fails typed, before it changes anything. Runs the
// setup in a child process (without CAP_NET_ADMIN, through setpriv, when run as root). Real host,
// nothing is created: each refusal comes before the first change.
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';

const root = join(__dirname, '..', '..');
const ATTEMPT = `
const { HostNetwork } = require(${JSON.stringify(join(root, 'src', 'network', 'host-network'))});
const { parseNetworkOption } = require(${JSON.stringify(join(root, 'src', 'network', 'options'))});
HostNetwork.setup(parseNetworkOption(process.argv[1] === 'tap' ? { tap: 'pvnosuchtap0' } : 'nat')).then(() => console.log('set up'),
  (e) => console.log(JSON.stringify({ name: e.name, reason: e.reason, message: e.message })));`;

function attempt(kind: 'nat' | 'tap', dropNetAdmin: boolean): { name: string; reason: string; message: string } {
  const node = [process.execPath, '-e', ATTEMPT, kind];
  const argv = dropNetAdmin ? ['setpriv', '--bounding-set', '-net_admin', '--inh-caps', '-net_admin', ...node] : node;
  const r = spawnSync(argv[0], argv.slice(1), { encoding: 'utf8' });
  return JSON.parse(r.stdout);
}

const links = () => (spawnSync('ip', ['-o', 'link', 'show'], { encoding: 'utf8' }).stdout ?? '').split('\n').filter((l) => /: pv[0-9]+n[0-9]+[:@]/.test(l));

describe('network setup refusals', () => {
  const canDrop = process.getuid?.() === 0 && spawnSync('setpriv', ['--version']).status === 0;
  (canDrop ? it : it.skip)("'nat' without CAP_NET_ADMIN is a NetworkSetupError 'permission' saying what it needs", () => {
    const before = links();
    const e = attempt('nat', true);
    expect(e).toMatchObject({ name: 'NetworkSetupError', reason: 'permission' });
    expect(e.message).toMatch(/CAP_NET_ADMIN/);
    expect(links()).toEqual(before);
  });

  it("a TAP that does not exist, or a host without vhost-net, is refused before anything is opened", () => {
    const e = attempt('tap', false);
    expect(e.name).toBe('NetworkSetupError');
    if (!existsSync('/dev/vhost-net')) expect(e).toMatchObject({ reason: 'unsupported', message: expect.stringMatching(/\/dev\/vhost-net does not exist/) });
    else expect(e).toMatchObject({ reason: 'failed', message: expect.stringMatching(/no network interface named pvnosuchtap0/) });
  });
});
