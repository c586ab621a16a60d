// The pure parts of hostname egress: the rules as the user writes them, which names and addresses
// they let through, the CNAME chain an answer is judged by, the nft scripts, and the set's
// bookkeeping (with a stand-in for nft: the real one runs in egress-resolver.test.ts).
import { InvalidOptionError } from '../../src/errors';
import { parseIpv4 } from '../../src/network/addresses';
import { followChain } from '../../src/network/egress-resolver';
import { addressDenied, MAX_RULES, nameAllowed, nameDenied, normalizeName, parseEgressPolicy, parseEgressRule, formatEgressRule } from '../../src/network/egress-rules';
import { EgressSet, EgressSetFullError, elementTtlS, MAX_ELEMENT_TTL_S, MIN_ELEMENT_TTL_S, setElementsScript } from '../../src/network/egress-set';
import { egressChainRules, egressUpdateScript } from '../../src/network/nft-rules';
import { natOptionOf, networkFromCli, parseNetworkOption } from '../../src/network/options';

const policy = (allow: string[] | undefined, deny?: string[]) => parseEgressPolicy(allow, deny);

describe('egress rules as written', () => {
  it('takes hostnames, *.domain and CIDR[:PORT] mixed, normalized', () => {
    expect(parseEgressRule('API.OpenAI.com.', 'a')).toEqual({ kind: 'host', name: 'api.openai.com', wildcard: false });
    expect(parseEgressRule('*.pypi.org', 'a')).toEqual({ kind: 'host', name: 'pypi.org', wildcard: true });
    expect(parseEgressRule('_dns._udp.example.com', 'a')).toMatchObject({ kind: 'host', name: '_dns._udp.example.com' });
    expect(parseEgressRule('10.1.0.0/16:443', 'a')).toEqual({ kind: 'cidr', network: { address: parseIpv4('10.1.0.0'), prefixLength: 16 }, port: 443 });
    expect(parseEgressRule('192.0.2.7', 'a')).toEqual({ kind: 'cidr', network: { address: parseIpv4('192.0.2.7'), prefixLength: 32 } });
    for (const r of ['api.openai.com', '*.pypi.org', '10.1.0.0/16:443', '192.0.2.7/32']) expect(formatEgressRule(parseEgressRule(r, 'a'))).toBe(r);
  });

  it('refuses what is neither, naming the list and the index', () => {
    const bad = ['', '*', '*.', '*foo.com', 'a..b', '-a.com', 'a-.com', 'foo.123', '999.1.1.1/32', '10.0.0.1/8', '10.0.0.0/8:0', '10.0.0.0/8:65536',
      'api.openai.com:443', 'a b.com', 'ex\u00e4mple.com', `${'a'.repeat(64)}.com`, `${'a.'.repeat(127)}com`, 'http://example.com'];
    for (const b of bad) expect(() => parseEgressRule(b, 'network.allow[0]')).toThrow(InvalidOptionError);
    expect(() => parseEgressPolicy(['ok.test', 'bad..name'], undefined)).toThrow(/^network\.allow\[1\]: "bad\.\.name" is neither a hostname/);
    expect(() => parseEgressPolicy(['ok.test'], ['x.test', 7])).toThrow(/^network\.deny\[1\]: expected hostname/);
    expect(() => parseEgressPolicy(['api.openai.com:443'], undefined)).toThrow(/a port goes only with a CIDR rule/);
    expect(() => parseEgressPolicy('ok.test', undefined)).toThrow(/^network\.allow: expected an array/);
    expect(() => parseEgressPolicy(Array(MAX_RULES + 1).fill('a.test'), undefined)).toThrow(/at most 1024 rules/);
    expect(() => parseNetworkOption({ mode: 'nat', allow: ['a.test'], deny: ['*.'] })).toThrow(/^network\.deny\[0\]/);
  });

  it('names: an exact rule is that name; *.domain every name under it at any depth, not the domain; deny wins', () => {
    const p = policy(['api.openai.com', '*.pypi.org'], ['evil.pypi.org', '*.bad.pypi.org']);
    expect(nameAllowed(p, 'api.openai.com')).toBe(true);
    expect(nameAllowed(p, 'x.api.openai.com')).toBe(false);
    expect(nameAllowed(p, 'files.pypi.org')).toBe(true);
    expect(nameAllowed(p, 'a.b.pypi.org')).toBe(true);
    expect(nameAllowed(p, 'pypi.org')).toBe(false);
    expect(nameAllowed(p, 'notpypi.org')).toBe(false);
    expect(nameAllowed(p, 'evil.pypi.org')).toBe(false);
    expect(nameAllowed(p, 'x.bad.pypi.org')).toBe(false);
    expect(nameDenied(p, 'x.bad.pypi.org')).toBe(true);
    // No allow list: every name but the denied ones.
    const open = policy(undefined, ['denied.test']);
    expect([nameAllowed(open, 'any.where'), nameAllowed(open, 'denied.test')]).toEqual([true, false]);
    expect(nameAllowed(policy([]), 'api.openai.com')).toBe(false);
  });

  it('addresses: a port-less CIDR deny closes the address whatever name it came from', () => {
    const p = policy(['*.test'], ['192.0.2.0/24', '198.51.100.7/32:22']);
    expect(addressDenied(p, parseIpv4('192.0.2.9')!)).toBe(true);
    expect(addressDenied(p, parseIpv4('198.51.100.7')!)).toBe(false); // only port 22 of it, in nft
  });

  it('normalizes names as DNS compares them, refusing what no rule could name', () => {
    expect(normalizeName('WWW.Example.COM.')).toBe('www.example.com');
    for (const bad of ['', '.', 'a..b', 'a\u0000b.com', 'a/b.com']) expect(normalizeName(bad)).toBeUndefined();
  });
});

describe('the CNAME chain an answer is judged by', () => {
  const p = policy(['www.example.test'], ['tracker.test']);
  const cname = (name: string, data: string, ttl = 300) => ({ type: 'CNAME' as const, name, data, ttl, class: 'IN' as const });
  const a = (name: string, data: string, ttl = 300) => ({ type: 'A' as const, name, data, ttl, class: 'IN' as const });

  it('follows CNAMEs to the final A records, with the smallest TTL; records off the chain are left out', () => {
    const c = followChain('www.example.test', 'A', [cname('www.example.test', 'edge.cdn.test', 60), a('edge.cdn.test', '192.0.2.1', 20), a('edge.cdn.test', '192.0.2.2'), a('other.test', '203.0.113.9')], p);
    expect(c).toMatchObject({ kind: 'ok', names: ['www.example.test', 'edge.cdn.test'], ttlS: 20 });
    if (c.kind !== 'ok') throw new Error('not ok');
    expect(c.addresses).toEqual([parseIpv4('192.0.2.1'), parseIpv4('192.0.2.2')]);
    expect(c.records.map((r) => r.name)).toEqual(['www.example.test', 'edge.cdn.test', 'edge.cdn.test']);
  });

  it('refuses a chain through a denied name; breaks on a loop, a chain too long, a bad target or address', () => {
    expect(followChain('www.example.test', 'A', [cname('www.example.test', 'tracker.test'), a('tracker.test', '192.0.2.1')], p)).toEqual({ kind: 'refused', name: 'tracker.test' });
    expect(followChain('www.example.test', 'A', [cname('www.example.test', 'b.test'), cname('b.test', 'www.example.test')], p).kind).toBe('broken');
    const long = Array.from({ length: 12 }, (_, i) => cname(i ? `n${i}.test` : 'www.example.test', `n${i + 1}.test`));
    expect(followChain('www.example.test', 'A', long, p)).toMatchObject({ kind: 'broken', why: expect.stringMatching(/longer than 8/) });
    expect(followChain('www.example.test', 'A', [cname('www.example.test', 'bad..name')], p).kind).toBe('broken');
    expect(followChain('www.example.test', 'A', [{ ...a('www.example.test', 'x'), data: 'not-an-address' }], p).kind).toBe('broken');
  });

  it('an answer without records is an empty chain, TTL 0', () => {
    expect(followChain('www.example.test', 'A', [], p)).toEqual({ kind: 'ok', names: ['www.example.test'], records: [], addresses: [], ttlS: 0 });
  });
});

describe('the set of opened addresses', () => {
  it('bounds each element lifetime below and above', () => {
    expect([0, 5, 45, 86400].map(elementTtlS)).toEqual([MIN_ELEMENT_TTL_S, MIN_ELEMENT_TTL_S, 45, MAX_ELEMENT_TTL_S]);
  });

  it('refreshes an element as add, delete, add in one script, and removes by add then delete', () => {
    expect(setElementsScript('t', [{ address: parseIpv4('192.0.2.1')!, timeoutS: 60 }], [parseIpv4('192.0.2.2')!])).toBe([
      'add element inet t hosts { 192.0.2.1 timeout 60s }',
      'delete element inet t hosts { 192.0.2.1 }',
      'add element inet t hosts { 192.0.2.1 timeout 60s }',
      'add element inet t hosts { 192.0.2.2 timeout 1s }',
      'delete element inet t hosts { 192.0.2.2 }',
      '',
    ].join('\n'));
  });

  it('runs nft only when an element is new or past half its life, caps the count, and records nothing nft refused', async () => {
    const scripts: string[] = [];
    let fail = false;
    const set = new EgressSet('t', async (s) => {
      if (fail) throw new Error('nft said no');
      scripts.push(s);
    }, 3);
    const [a, b, c, d] = ['192.0.2.1', '192.0.2.2', '192.0.2.3', '192.0.2.4'].map((x) => parseIpv4(x)!);
    await set.open([a, b, a], 60, ['one.test']);
    expect(scripts).toHaveLength(1);
    expect(scripts[0].match(/^add element .* timeout 60s }$/gm)).toHaveLength(4);
    await set.open([a], 60, ['two.test']);
    expect(scripts).toHaveLength(1); // still more than half of 60 s left
    await expect(set.open([c, d], 60, ['three.test'])).rejects.toThrow(EgressSetFullError);
    expect([set.size, set.has(c)]).toEqual([2, false]);
    fail = true;
    await expect(set.open([c], 60, ['three.test'])).rejects.toThrow(/nft said no/);
    expect(set.has(c)).toBe(false);
    fail = false;
    // a was opened for one.test and two.test, b for one.test: with one.test gone, a stays.
    expect(await set.retain((_addr, chain) => chain[0] !== 'one.test')).toEqual([b]);
    expect([set.has(a), set.has(b)]).toEqual([true, false]);
    expect(scripts[scripts.length - 1]).toBe('add element inet t hosts { 192.0.2.2 timeout 1s }\ndelete element inet t hosts { 192.0.2.2 }\n');
  });
});

describe('the egress chain', () => {
  it('drops what deny names first, then accepts the allow rules and the resolver set', () => {
    const p = policy(['a.test', '192.0.2.0/24', '198.51.100.7/32:443'], ['192.0.2.9/32', '192.0.2.10/32:22']);
    expect(egressChainRules(p, true)).toEqual([
      'ip daddr 192.0.2.9/32 drop',
      'ip daddr 192.0.2.10/32 tcp dport 22 drop',
      'ip daddr 192.0.2.10/32 udp dport 22 drop',
      'ip daddr 192.0.2.0/24 accept',
      'ip daddr 198.51.100.7/32 tcp dport 443 accept',
      'ip daddr 198.51.100.7/32 udp dport 443 accept',
      'ip daddr @hosts accept',
    ]);
    expect(egressChainRules(policy(undefined, ['192.0.2.9/32']), true)).toEqual(['ip daddr 192.0.2.9/32 drop', 'accept']);
    expect(egressChainRules({ allow: 'all', deny: [] }, false)).toEqual(['accept']);
    expect(egressUpdateScript('pvisor_1_0', policy([]), true)).toBe('flush chain inet pvisor_1_0 egress\nadd rule inet pvisor_1_0 egress ip daddr @hosts accept\n');
  });
});

describe('the option, the CLI flags and what a snapshot records', () => {
  it('turns --net-allow and --net-deny into the option, and refuses them without --net nat', () => {
    expect(networkFromCli('nat', ['api.openai.com'], ['10.0.0.0/8'])).toEqual({ mode: 'nat', allow: ['api.openai.com'], deny: ['10.0.0.0/8'] });
    expect(networkFromCli('nat', [], ['evil.test'])).toEqual({ mode: 'nat', deny: ['evil.test'] });
    expect(networkFromCli('nat', [], [])).toBe('nat');
    expect(() => networkFromCli('none', [], ['evil.test'])).toThrow(/^--net-deny: needs --net nat/);
    expect(() => networkFromCli('tap:tap0', ['a.test'], [])).toThrow(/^--net-allow: needs --net nat/);
  });

  it('gives the resolver only to a VM with allow or deny, and a snapshot of one records both lists', () => {
    expect(parseNetworkOption('nat')).toMatchObject({ resolver: false });
    expect(parseNetworkOption({ mode: 'nat' })).toMatchObject({ resolver: false });
    expect(parseNetworkOption({ mode: 'nat', deny: [] })).toMatchObject({ resolver: true, egress: { allow: 'all', deny: [] } });
    const plan = parseNetworkOption({ mode: 'nat', allow: ['api.openai.com', '*.pypi.org', '10.1.0.0/16:443'], deny: ['evil.pypi.org'], dns: '192.0.2.53' });
    if (plan.kind !== 'nat') throw new Error('not nat');
    const saved = JSON.parse(JSON.stringify(natOptionOf(plan)));
    expect(saved).toMatchObject({ allow: ['api.openai.com', '*.pypi.org', '10.1.0.0/16:443'], deny: ['evil.pypi.org'] });
    expect(parseNetworkOption(saved)).toEqual(plan);
  });
});
