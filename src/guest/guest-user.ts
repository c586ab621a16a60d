/**
 * The `user` option of exec, spawn and the files calls (docs/agent-protocol.md, "Users"): a user
 * name the guest's /etc/passwd resolves, or numeric `uid:gid`. Checked here by the grammar the
 * agent applies (agent-users.h), so a malformed one is refused before anything is sent; an agent
 * that cannot run as a user is refused too, rather than sent a request it would read wrongly.
 */
import { GuestFeatureError, InvalidOptionError } from '../errors';
import { FEATURE_USERS, type AgentClient } from '../protocol/agent-client';

/** The highest id: (uid_t)-1 means "unchanged" to the kernel, never a user. */
const MAX_ID = 4294967294;
/** A name as shadow-utils' useradd accepts one, 1 to 32 bytes (agent-users.h, pv_user_name_ok). */
const USER_NAME = /^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}$|^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,30}\$$/;
/** A decimal id without sign or leading zero (agent-users.h, pv_parse_id). */
const ID = /^(0|[1-9][0-9]{0,9})$/;

/**
 * Whether `value` is a user spec the agent takes: a name, or `uid:gid` with both 0 to 4294967294.
 */
export function isUserSpec(value: string): boolean {
  if (USER_NAME.test(value)) return true;
  const parts = value.split(':');
  return parts.length === 2 && parts.every((p) => ID.test(p) && Number(p) <= MAX_ID);
}

/**
 * The `user` option checked: undefined (the agent's own user, root), or a user spec that this
 * guest's agent can run as. A malformed one is an {@link InvalidOptionError}; an agent without
 * the USERS feature a {@link GuestFeatureError} (nothing is sent).
 */
export function userOption(agent: AgentClient, value: unknown): string | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'string' || !isUserSpec(value)) {
    throw new InvalidOptionError('user', `expected a user name (letters, digits, '_', '.', '-', up to 32) or "uid:gid", got ${typeof value === 'string' ? JSON.stringify(value.slice(0, 80)) : typeof value}`);
  }
  if (!agent.hasFeature(FEATURE_USERS)) {
    throw new GuestFeatureError(
      'users',
      `user: the guest agent cannot run as a user (its HELLO lacks the USERS feature): its initramfs was built before this pvisor's agent; rebuild it with this pvisor's agent (native-prebuilds/linux-guest/build-initramfs.sh)`,
    );
  }
  return value;
}
